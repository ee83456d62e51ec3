"""The package version, in the lowest layer so that any module can record it without importing
the :mod:`pyrobdl` facade (docs/architecture.md)."""

__version__ = "0.1.0"
