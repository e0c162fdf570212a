"""The package version (one place: pyproject.toml reads it too)."""

__all__ = ["__version__"]


__version__ = "0.4.0"
