"""The Hexagon (HTP) plugin: ggml's Hexagon NPU backend, EMULATED.

There is no Snapdragon NPU here. The host side is modelled on ggml's (devices HTP0..N,
op batching, host-computed kernel parameters, a per-graph cache, fusion, a weight repack
buffer); the NPU side is C compiled for the host (``accelplane_hexagon._htp``) that keeps the
DSP's data layouts and arithmetic: 32x32 weight tiles, Q8_0 dynamic quantization of
activations, int8 dot products, fp16 per-tile accumulators. Timings of this plugin are host
CPU timings of an emulation, never NPU performance.

Like the real backend, ``graph_compute`` is synchronous (it returns when the NPU has answered
every batch); the async hooks and events are left to the SDK's fallbacks (docs/ordering.md).

Environment: ACCELPLANE_HEXAGON_NDEV (devices, default 1), ACCELPLANE_HEXAGON_OPBATCH (ops per
batch, default 1024), ACCELPLANE_HEXAGON_OPFUSION (0 disables fusion),
ACCELPLANE_HEXAGON_ACC (matmul accumulators: fp16, the default, or fp32).
"""

from __future__ import annotations

import numpy as np
from accelplane.errors import AllocationError
from accelplane.interface import BufferTypeSpec, DeviceCaps, DeviceSpec, DeviceType, hookimpl

from . import npu, repack, tuning
from .fusion import reorder
from .runtime import ALIGNMENT, BackendState, BuftState, DevState, HtpBuffer, Options
from .support import supports_op as _supports_op

DESCRIPTION = ("Hexagon HTP, emulated: NPU kernels in host C with the DSP's data layouts and "
               "arithmetic (no NPU present; timings are not NPU performance)")  # fmt: skip


# --- registration and device ------------------------------------------------------------------
@hookimpl
def api_version():
    return (1, 1)  # the interface version this plugin was written for: a literal, never the SDK's


@hookimpl
def get_devices():
    npu.check_built()  # a missing build is a broken runtime, reported by the registry
    # the emulator loads on a device's first backend (npu.load: the device's runtime)
    return [DeviceSpec(f"HTP{i}", DESCRIPTION, DeviceType.ACCEL, DeviceCaps(emulated=True), DevState(i),
                       open=npu.load) for i in range(tuning.read().ndev)]  # fmt: skip


@hookimpl
def device_memory(device):
    return 0, 0  # the real backend reports none either: the memory is the host's


@hookimpl
def init_backend(device, backend, params):
    return BackendState(Options.parse(params))  # (the SDK has opened the device: the emulator is loaded)


@hookimpl
def get_buffer_type(device):
    return BufferTypeSpec(device.name, BuftState(repack=False))


@hookimpl
def get_extra_buffer_types(device):
    return [BufferTypeSpec(f"{device.name}-REPACK", BuftState(repack=True))]


@hookimpl
def supports_op(device, op):
    return _supports_op(op)


@hookimpl
def supports_buft(device, buft):
    return buft.device is device


# --- buffer types and buffers -----------------------------------------------------------------
@hookimpl
def buft_alloc(buft, buffer, size):
    try:
        return HtpBuffer(size, buft.ctx.repack)
    except MemoryError as e:
        raise AllocationError(f"{buft.name}: cannot allocate {size} bytes") from e


@hookimpl
def buft_alignment(buft):
    return ALIGNMENT


@hookimpl
def buft_alloc_size(buft, tensor):
    return repack.alloc_size(tensor) if repack.tiled_in(buft, tensor) else tensor.nbytes


@hookimpl
def buft_is_host(buft):
    return not buft.ctx.repack  # repacked tiles are not ggml layout


@hookimpl
def buffer_host_array(buffer):
    return buffer.ctx.mem


@hookimpl
def buffer_free(buffer):
    buffer.ctx.mem = np.zeros(0, np.uint8)


@hookimpl
def buffer_init_tensor(buffer, tensor):
    if repack.tiled_in(buffer.buft, tensor):
        tensor.extra = repack.tile_info(tensor)


@hookimpl
def buffer_set_tensor(buffer, tensor, data, offset, size):
    tiled = repack.tiles_of(buffer, tensor)
    if tiled is None:
        start = tensor.offs + offset
        buffer.ctx.mem[start : start + size] = data[:size]
        return
    o, region, base = tiled
    start = base + offset
    if start == 0 and size == o.nbytes:
        std = data[:size]
    else:  # a partial write: patch the ggml-layout bytes and repack the whole tensor
        std = repack.unpack(region, o.extra, o.ne[1])
        std[start : start + size] = data[:size]
    region[:] = repack.pack(std, o.extra, o.ne[1])


@hookimpl
def buffer_get_tensor(buffer, tensor, out, offset, size):
    tiled = repack.tiles_of(buffer, tensor)
    if tiled is None:
        start = tensor.offs + offset
        out[:size] = buffer.ctx.mem[start : start + size]
        return
    o, region, base = tiled
    start = base + offset
    out[:size] = repack.unpack(region, o.extra, o.ne[1])[start : start + size]


@hookimpl
def buffer_clear(buffer, value):
    buffer.ctx.mem[:] = value


# --- the stream -------------------------------------------------------------------------------
@hookimpl
def graph_optimize(backend, graph):
    reorder(graph)


@hookimpl
def graph_compute(backend, graph):
    backend.ctx.compute(graph)
