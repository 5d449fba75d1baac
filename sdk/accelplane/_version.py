"""The SDK's version, in one place: the package metadata (pyproject.toml reads it) and
``accelplane.__version__``."""

__version__ = "0.1.0"
