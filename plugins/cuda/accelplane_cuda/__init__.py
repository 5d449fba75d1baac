"""The accelplane CUDA plugin (entry point ``cuda = accelplane_cuda.plugin``)."""

__version__ = "0.1.0"
