"""The built-in CPU plugin: host memory buffers, numpy for what numpy does well (BLAS GEMM,
elementwise), C kernels (cffi, accelplane.cpu._kernels) for quantized products.

Registered through the ``accelplane.plugins`` entry point like any vendor plugin. The
backend is synchronous: graph_compute returns when the work is done, so the async hooks and
events are left to the SDK's fallbacks (docs/ordering.md). Besides host memory ("CPU") it offers
the repack buffer type (accelplane.cpu.repack) for weights.
"""

from __future__ import annotations

import numpy as np

from accelplane.core.ops import RULES, Op
from accelplane.cpu import host, repack
from accelplane.errors import AllocationError
from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl
from accelplane.runtime.dlpack import HOST_MEMORY, host_bytes
from accelplane.runtime.plancache import PlanCache

ALIGNMENT = 64
_SUPPORTED = frozenset(RULES) - {Op.NONE}


@hookimpl
def api_version():
    return (1, 2)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    name = f"{host.cpu_name()} ({host.usable_cpus()} threads)"
    return [DeviceSpec("CPU", name, DeviceType.CPU, DeviceCaps())]


@hookimpl
def device_memory(device):
    return host.memory()


def _memory(buffer) -> np.ndarray:
    """A buffer's bytes as the plans read them: host memory, or the repack buffer's array."""
    return buffer.ctx if repack.is_repack(buffer) else buffer.host_array


def _plan(graph):
    from accelplane.cpu.plan import Plan

    return Plan(graph, _memory)


@hookimpl
def init_backend(device, backend, params):
    return PlanCache(_plan)


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec("CPU")


@hookimpl
def get_extra_buffer_types(device):
    return [BufferTypeSpec(repack.NAME)]


@hookimpl
def supports_op(device, op):
    # every op of the catalog, for every type combination the catalog's rules admit
    return op.op in _SUPPORTED


@hookimpl
def supports_buft(device, buft):
    return buft.is_host or (buft.name == repack.NAME and buft.device is device)


@hookimpl
def buft_alloc(buft, buffer, size):
    try:
        raw = np.empty(size + ALIGNMENT, np.uint8)
    except MemoryError as e:
        raise AllocationError(f"CPU: cannot allocate {size} bytes") from e
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift : shift + size]


@hookimpl
def buft_alignment(buft):
    return ALIGNMENT


@hookimpl
def buft_is_host(buft):
    return buft.name != repack.NAME


@hookimpl
def buffer_host_array(buffer):
    return buffer.ctx


@hookimpl
def buffer_free(buffer):
    buffer.ctx = None


@hookimpl
def buffer_init_tensor(buffer, tensor):
    if repack.is_repack(buffer):
        repack.init_tensor(tensor)


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    if repack.is_repack(buffer):
        repack.write(buffer, tensor, data, offset, size)
        return
    start = tensor.offs + offset
    buffer.ctx[start : start + size] = data[:size]


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    if repack.is_repack(buffer):
        repack.read(buffer, tensor, out, offset, size)
        return
    start = tensor.offs + offset
    out[:size] = buffer.ctx[start : start + size]


@hookimpl
def buffer_memset_tensor(buffer, tensor, value, offset, size):
    if repack.is_repack(buffer):  # a byte range of ggml's layout: not the stored one
        repack.write(buffer, tensor, np.full(size, value, np.uint8), offset, size)
        return
    start = tensor.offs + offset
    buffer.ctx[start : start + size] = value


@hookimpl
def buffer_clear(buffer, value):
    buffer.ctx[:] = value


@hookimpl
def buft_from_dlpack(buft, buffer, memory, size):
    # host memory at any element-aligned address: numpy and the C kernels take unaligned rows.
    # Exports need no hook: the SDK shares a host buffer's memory (buffer_host_array).
    if memory.device_type not in HOST_MEMORY:
        return None
    return host_bytes(memory.ptr, size, memory.owner)


@hookimpl
def graph_compute(backend, graph):
    backend.ctx.get(graph).run()
