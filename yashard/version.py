"""The version of yashard: one place, imported by the package root and by what records it (a
checkpoint's index), so that nothing inside the package imports the package root."""

__version__ = "0.1.0"
