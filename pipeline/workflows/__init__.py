"""What the commands do: model loading, workspaces, build-cache, run, bench, demo."""
