"""kvf's version, in a module of its own so that any layer can name it without importing the package API."""
__version__ = "0.1.0"
