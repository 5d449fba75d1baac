"""accelplane's SYCL plugin (dpctl): per-instance in-order queues, USM buffers, OpenCL C kernels,
oneMKL matmul through dpnp. The entry-point module is :mod:`accelplane_sycl.plugin`."""

__version__ = "0.1.0"
