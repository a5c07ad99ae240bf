"""kvf.eval: scoring run records (metrics, statistics), reports, plots and per-question comparisons."""
