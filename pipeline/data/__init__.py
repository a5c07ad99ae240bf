"""Datasets as prepared directories: benchmark loaders, the synthetic set, the RULER-style suite, your own questions."""
