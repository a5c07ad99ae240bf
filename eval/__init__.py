"""kvf.eval: benchmark loaders (datasets), a synthetic corpus, answer metrics and the run report."""
