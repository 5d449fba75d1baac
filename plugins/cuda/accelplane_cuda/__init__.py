"""The accelplane CUDA plugin (entry point ``cuda = accelplane_cuda.plugin``)."""
