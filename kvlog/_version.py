"""The package's version, in a module of its own so any layer can name it without importing
the package root (which imports the Engine)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
