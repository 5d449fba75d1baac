"""DLPack: tensors exchanged with other array libraries (numpy, torch, CuPy, dpnp) without a copy
where their memory allows it (docs/interop.md says where).

``Tensor.__dlpack__`` / ``Tensor.__dlpack_device__`` (the array API's producer side) are
:func:`export` and :func:`dlpack_device`; :func:`from_dlpack` is its consumer side. The plugin
hooks behind them (buffer_dlpack, device_dlpack_wait, buft_from_dlpack) and their fallbacks are
in :mod:`accelplane.runtime.backend`.

Capsules are the DLPack ABI (dlpack.h): ``DLManagedTensorVersioned`` in a ``"dltensor_versioned"``
capsule when the consumer passes ``max_version >= (1, 0)``, the legacy ``DLManagedTensor`` in a
``"dltensor"`` capsule otherwise. accelplane lets numpy build them, from a numpy array over the
exported memory (numpy never reads it: the address may be a device's), and writes the device and
type fields numpy cannot know: numpy's C deleter then releases them, so no Python callback runs
inside a consumer's deleter. That array's base is a :class:`_Span`, which keeps the exported
memory alive until the consumer lets the capsule go.
"""

from __future__ import annotations

import ctypes as c
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from accelplane.core import tensor as _tensor
from accelplane.core.tensor import GGML_MAX_DIMS, Tensor
from accelplane.core.types import GGMLType
from accelplane.errors import DLPackError, ShapeError, TypeMismatchError
from accelplane.interface import DLDeviceType, DLPackMemory
from accelplane.runtime.backend import BufferUsage, tensor_copy
from accelplane.runtime.data import check_range

if TYPE_CHECKING:
    from accelplane.runtime.backend import Buffer, Device

CPU = (DLDeviceType.CPU, 0)
# memory the host reads and writes at its address (numpy takes these too)
HOST_MEMORY = frozenset({DLDeviceType.CPU, DLDeviceType.CUDA_HOST, DLDeviceType.ROCM_HOST,
                         DLDeviceType.CUDA_MANAGED})  # fmt: skip
VERSION = (1, 0)  # the DLPack version of the capsules accelplane reads (and asks producers for)

# DLDataTypeCode: kDLInt 0, kDLFloat 2, kDLBfloat 4
_CODES = {GGMLType.F32: (2, 32), GGMLType.F16: (2, 16), GGMLType.BF16: (4, 16), GGMLType.I32: (0, 32)}
_TYPES = {v: k for k, v in _CODES.items()}
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool"}
_FLAG_READ_ONLY, _FLAG_IS_COPIED = 1, 2


# --- the ABI (dlpack.h) ------------------------------------------------------------------------------
class _DLDevice(c.Structure):
    _fields_ = [("device_type", c.c_int32), ("device_id", c.c_int32)]


class _DLDataType(c.Structure):
    _fields_ = [("code", c.c_uint8), ("bits", c.c_uint8), ("lanes", c.c_uint16)]


class _DLTensor(c.Structure):
    _fields_ = [("data", c.c_void_p), ("device", _DLDevice), ("ndim", c.c_int32), ("dtype", _DLDataType),
                ("shape", c.POINTER(c.c_int64)), ("strides", c.POINTER(c.c_int64)),
                ("byte_offset", c.c_uint64)]  # fmt: skip


class _DLManagedTensor(c.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c.c_void_p), ("deleter", c.c_void_p)]


class _DLPackVersion(c.Structure):
    _fields_ = [("major", c.c_uint32), ("minor", c.c_uint32)]


class _DLManagedTensorVersioned(c.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", c.c_void_p), ("deleter", c.c_void_p),
                ("flags", c.c_uint64), ("dl_tensor", _DLTensor)]  # fmt: skip


_NAMES = {b"dltensor": (_DLManagedTensor, b"used_dltensor"),
          b"dltensor_versioned": (_DLManagedTensorVersioned, b"used_dltensor_versioned")}  # fmt: skip
_USED = {v[1] for v in _NAMES.values()}
_GetName = c.PYFUNCTYPE(c.c_char_p, c.py_object)(("PyCapsule_GetName", c.pythonapi))
_GetPointer = c.PYFUNCTYPE(c.c_void_p, c.py_object, c.c_char_p)(("PyCapsule_GetPointer", c.pythonapi))
_SetName = c.PYFUNCTYPE(c.c_int, c.py_object, c.c_char_p)(("PyCapsule_SetName", c.pythonapi))
_Deleter = c.PYFUNCTYPE(None, c.c_void_p)  # called holding the GIL, as a Python consumer would


def _managed(capsule: Any) -> tuple[bytes, Any]:
    """The capsule's name and its (versioned or legacy) managed tensor struct."""
    name = _GetName(capsule)
    if name not in _NAMES:
        used = " (already consumed: a capsule is consumed once)" if name in _USED else ""
        raise DLPackError(f"not a DLPack capsule: its name is {name!r}{used}")
    return name, _NAMES[name][0].from_address(_GetPointer(capsule, name))


class _Span:
    """An ``__array_interface__`` over memory numpy does not own, and what keeps that memory alive:
    every numpy array made from it holds it as its base. ``release`` runs when the last goes."""

    __slots__ = ("__array_interface__", "owner", "_release")

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None, typestr: str,
                 owner: Any, release: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "strides": strides,
                                    "typestr": typestr, "version": 3}  # fmt: skip
        self.owner = owner
        self._release = release

    def __del__(self) -> None:
        r, self._release = self._release, None
        if r is not None:
            r()


def host_bytes(ptr: int, size: int, owner: Any) -> np.ndarray:
    """A writable uint8 array over ``size`` bytes of host memory at ``ptr`` that keeps ``owner``
    alive: what a plugin's buft_from_dlpack returns for host memory it wraps."""
    return np.asarray(_Span(ptr, (size,), None, "|u1", owner))


# --- the producer: Tensor.__dlpack__ ---------------------------------------------------------------------
def _label(t: Tensor) -> str:
    return repr(t.name or t.uid)


def _check_copy(copy: Any, where: str) -> bool | None:
    if copy is None or isinstance(copy, bool | np.bool_):
        return None if copy is None else bool(copy)
    raise TypeMismatchError(f"{where}: copy must be None, True or False, got {copy!r}")


def _device_arg(dl_device: Any) -> tuple[DLDeviceType, int] | None:
    if dl_device is None:
        return None
    try:
        kind, index = dl_device
        kind, index = DLDeviceType(int(kind)), int(index)
    except (TypeError, ValueError):
        raise DLPackError(f"__dlpack__: dl_device must be (DLPack device type, device id) as "
                          f"__dlpack_device__ returns it, got {dl_device!r}") from None  # fmt: skip
    return kind, index


def _version_arg(max_version: Any) -> tuple[int, int] | None:
    if max_version is None:
        return None
    if (not isinstance(max_version, tuple) or len(max_version) != 2
            or not all(isinstance(x, int) and x >= 0 for x in max_version)):  # fmt: skip
        raise TypeMismatchError(f"__dlpack__: max_version must be (major, minor), got {max_version!r}")
    return max_version


def _exportable(t: Tensor) -> Buffer:
    buf = check_range(t, 0, t.nbytes)  # allocated, not freed (BufferFreedError)
    if t.type.is_quantized:
        raise DLPackError(
            f"tensor {_label(t)} is {t.type.name}, a block-quantized type: DLPack has no type for it "
            "(get() gives its values dequantized, get_bytes() its blocks)"
        )
    return buf


def dlpack_device(t: Tensor) -> tuple[DLDeviceType, int]:
    """``Tensor.__dlpack_device__``: where ``__dlpack__()`` puts the tensor: its own memory's
    DLPack device when other libraries can address it, else ``(CPU, 0)`` (a host copy)."""
    buf = check_range(t, 0, t.nbytes)
    mem = None if t.type.is_quantized else buf.dlpack_memory(t)
    return (mem.device_type, mem.device_id) if mem is not None else CPU


def export(t: Tensor, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
           copy: Any = None) -> Any:  # fmt: skip
    """``Tensor.__dlpack__`` (the array API's): a DLPack capsule of the tensor.

    Zero-copy when the tensor's memory is addressable on the device asked for (``dl_device``,
    default: the tensor's own, :func:`dlpack_device`) and ``copy`` is not True; the capsule then
    keeps the buffer's memory alive (freeing the buffer waits for it) and writes are seen both
    ways. Otherwise a copy (flagged IS_COPIED in a versioned capsule): in host memory for
    ``(CPU, 0)``, in a new buffer of the same buffer type for the tensor's own device; with
    ``copy=False`` that is a DLPackError (a BufferError) instead.

    ``stream`` is the consumer's: for host memory it must be None, and the host waits for the
    work queued on the device's backends; for device memory the plugin makes ``stream`` wait for
    that work (device_dlpack_wait), and ``-1`` asks for no ordering."""
    copy = _check_copy(copy, "__dlpack__")
    want = _device_arg(dl_device)
    max_version = _version_arg(max_version)
    buf = _exportable(t)
    mem = buf.dlpack_memory(t)
    native = (mem.device_type, mem.device_id) if mem is not None else CPU
    target = native if want is None else want
    if target == CPU and stream is not None:
        raise DLPackError(f"tensor {_label(t)}: stream must be None for CPU memory, got {stream!r}")
    share = mem if mem is not None and target == native else None
    if share is None and target == CPU and buf.is_host:  # host memory the plugin names otherwise
        share = DLPackMemory(DLDeviceType.CPU, 0, int(buf.host_array.ctypes.data) + t.offs)
    if share is not None and copy is not True:
        _order(buf.device, share, stream)
        buf.export_acquire()
        return _capsule(t, share, buf, buf.export_release, max_version, copied=False)
    if copy is False:
        why = (f"its memory is on {_dev_name(native)}" if share is None and mem is not None
               else f"the memory of buffer {buf.name!r} is not addressable by other libraries")  # fmt: skip
        raise DLPackError(f"tensor {_label(t)} cannot be exported to {_dev_name(target)} without a "
                          f"copy ({why}), and copy=False")  # fmt: skip
    if target == CPU:
        _synchronize(buf)
        arr = np.ascontiguousarray(t.get())
        return _capsule(t, DLPackMemory(DLDeviceType.CPU, 0, int(arr.ctypes.data)), arr, None, max_version,
                        copied=True, contiguous=True)  # fmt: skip
    if mem is not None and target == native:  # copy=True on the tensor's own device
        dup = _device_copy(t, buf)
        dmem = dup.buffer.dlpack_memory(dup)
        _order(buf.device, dmem, stream)
        return _capsule(dup, dmem, dup.buffer, dup.buffer.free, max_version, copied=True)
    raise DLPackError(f"tensor {_label(t)} is in buffer {buf.name!r} ({_dev_name(native)}): it cannot "
                      f"be exported to {_dev_name(target)}; ask for {_dev_name(native)} or the host "
                      "(DLDeviceType.CPU, 0)")  # fmt: skip


def _dev_name(d: tuple[DLDeviceType, int]) -> str:
    return f"DLPack {d[0].name}:{d[1]}"


def _synchronize(buf: Buffer) -> None:
    """Block the host until the backends of every device whose memory ``buf`` is (its parts' for
    a composite buffer, such as a meta device's) have done their queued work."""
    devices = {id(b.device): b.device for b in buf.buffers}
    for d in devices.values():
        d.synchronize_backends()


def _order(device: Device, mem: DLPackMemory, stream: Any) -> None:
    """Make the consumer safe to use ``mem`` after the work queued on ``device``'s backends."""
    if mem.device_type in HOST_MEMORY:
        device.synchronize_backends()  # the array API: CPU memory is synchronized by the producer
    else:
        device.dlpack_wait(stream)


def _device_copy(t: Tensor, buf: Buffer) -> Tensor:
    """A copy of ``t`` (same layout) in a new buffer of ``buf``'s type."""
    dup = Tensor(t.type, t.ne, t.nb, name=t.name, ndim=t.ndim)
    new = buf.buft.alloc(buf.buft.alloc_size(dup), BufferUsage.ANY)
    new.place(dup, 0)
    buf.device.synchronize_backends()  # a blocking copy reads what the backends have written
    tensor_copy(t, dup)
    return dup


def _capsule(t: Tensor, mem: DLPackMemory, owner: Any, release: Callable[[], None] | None,
             max_version: tuple[int, int] | None, copied: bool, contiguous: bool = False) -> Any:  # fmt: skip
    """A capsule over ``mem`` with ``t``'s shape and strides (numpy-ordered, in elements)."""
    code, bits = _CODES[t.type]
    strides = None if contiguous else t.strides
    # numpy sees unsigned integers of the element's size; the type is written into the capsule
    span = _Span(mem.ptr, t.shape, strides, f"<u{bits // 8}", owner, release)
    arr = np.asarray(span)
    del span  # the array (and then the capsule) holds it
    try:
        cap = arr.__dlpack__() if max_version is None else arr.__dlpack__(max_version=max_version)
    except TypeError:  # numpy before 2.1 exports legacy capsules only (consumers check the name)
        cap = arr.__dlpack__()
    name, m = _managed(cap)
    dl = m.dl_tensor
    dl.device.device_type, dl.device.device_id = int(mem.device_type), int(mem.device_id)
    dl.dtype.code, dl.dtype.bits, dl.dtype.lanes = code, bits, 1
    if name == b"dltensor_versioned":
        m.flags = (m.flags & ~_FLAG_READ_ONLY) | (_FLAG_IS_COPIED if copied else 0)
    return cap


# --- the consumer: from_dlpack ----------------------------------------------------------------------------
class _Received:
    """A DLPack tensor taken from a capsule (renamed "used_…"): its description, and the producer's
    deleter, called once when this object goes (it is the ``owner`` of a wrapped buffer)."""

    def __init__(self, capsule: Any) -> None:
        self._deleter = None
        name, m = _managed(capsule)
        self._deleter = m.deleter
        self._addr = c.addressof(m)
        self.versioned = name == b"dltensor_versioned"
        if _SetName(capsule, _NAMES[name][1]) != 0:  # consumed: its deleter is now ours to call
            raise DLPackError("could not mark the DLPack capsule as consumed")
        if self.versioned and m.version.major != VERSION[0]:
            version = f"{m.version.major}.{m.version.minor}"
            self.release()  # dlpack.h: safe to call whatever the version; nothing else is
            raise DLPackError(f"DLPack capsule of version {version}: accelplane reads major version "
                              f"{VERSION[0]}")  # fmt: skip
        dl = m.dl_tensor
        self.readonly = bool(self.versioned and m.flags & _FLAG_READ_ONLY)
        self.device = (DLDeviceType(dl.device.device_type) if dl.device.device_type in
                       DLDeviceType._value2member_map_ else dl.device.device_type, int(dl.device.device_id))
        self.dtype = (int(dl.dtype.code), int(dl.dtype.bits), int(dl.dtype.lanes))
        self.ndim = int(dl.ndim)
        if self.ndim < 0 or (self.ndim and not dl.shape):
            self.release()
            raise DLPackError(f"malformed DLPack tensor: ndim {self.ndim} without a shape")
        n = min(self.ndim, 64)
        self.shape = tuple(int(dl.shape[i]) for i in range(n))
        self.strides = None if not dl.strides or not n else tuple(int(dl.strides[i]) for i in range(n))
        self.ptr = (dl.data or 0) + int(dl.byte_offset)

    def release(self) -> None:
        d, self._deleter = self._deleter, None
        if d:
            _Deleter(d)(self._addr)

    def __del__(self) -> None:
        self.release()

    def where(self) -> str:
        kind = self.device[0]
        return f"DLPack {getattr(kind, 'name', kind)}:{self.device[1]}"


def _ask(x: Any, copy: bool | None, dl_device: tuple[int, int] | None = None) -> _Received:
    """The producer's capsule (the array API's consumer logic: max_version first, then without)."""
    kw: dict[str, Any] = {"max_version": VERSION}
    if dl_device is not None:
        kw["dl_device"] = dl_device
    if copy is False:
        kw["copy"] = False
    try:
        cap = x.__dlpack__(**kw)
    except TypeError:
        if dl_device is not None or copy is False:
            raise DLPackError(f"{type(x).__name__}.__dlpack__ does not take the array API's dl_device "
                              "and copy arguments: accelplane cannot ask it for a host copy") from None
        cap = x.__dlpack__()
    if type(cap).__name__ != "PyCapsule":
        raise DLPackError(f"{type(x).__name__}.__dlpack__ returned a {type(cap).__name__}, not a capsule")
    return _Received(cap)


def _layout(rec: _Received, name: str) -> tuple[GGMLType, tuple[int, ...], tuple[int, ...] | None]:
    """(type, ne, nb) of the received tensor: nb None for a contiguous one, () when no accelplane
    tensor can lie as it does (negative or zero strides)."""
    code, bits, lanes = rec.dtype
    typ = _TYPES.get((code, bits)) if lanes == 1 else None
    if typ is None:
        what = f"{_CODE_NAMES.get(code, f'code {code}')}{bits}" + (f"x{lanes}" if lanes != 1 else "")
        raise DLPackError(f"from_dlpack {name!r}: DLPack type {what} has no accelplane type (float32, "
                          "float16, bfloat16, int32); convert the array first")  # fmt: skip
    if rec.ndim > GGML_MAX_DIMS:
        raise ShapeError(f"from_dlpack {name!r}: {rec.ndim} dimensions {list(rec.shape)}; accelplane "
                         f"tensors have at most {GGML_MAX_DIMS}")  # fmt: skip
    if any(d < 0 for d in rec.shape):
        raise DLPackError(f"from_dlpack {name!r}: negative extent in shape {list(rec.shape)}")
    ne = tuple(reversed(rec.shape)) + (1,) * (GGML_MAX_DIMS - rec.ndim)
    if rec.strides is None:
        return typ, ne, None
    el = tuple(reversed(rec.strides)) + (0,) * (GGML_MAX_DIMS - rec.ndim)
    if any(s <= 0 and n > 1 for s, n in zip(el, ne, strict=True)):
        return typ, ne, ()  # negative or zero strides: no accelplane tensor lies so
    nb: list[int] = []
    for i in range(GGML_MAX_DIMS):  # an extent of one takes any stride: the contiguous one
        nb.append(el[i] * typ.type_size if ne[i] > 1 else typ.type_size if i == 0 else nb[i - 1] * ne[i - 1])
    return typ, ne, tuple(nb)


def _target(device: Any) -> Device | None:
    if device is None:
        return None
    from accelplane.runtime.backend import Device
    from accelplane.runtime.registry import get_registry

    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        return get_registry().device(device)
    raise TypeMismatchError(f"from_dlpack: device must be an accelplane Device or a device name, got "
                            f"{type(device).__name__}")  # fmt: skip


def _devices_for(rec: _Received) -> list[Device]:
    """Candidates for ``device=None``: the CPU device for host memory, else every device."""
    from accelplane.runtime.registry import get_registry

    devs = get_registry().devices
    if rec.device[0] in HOST_MEMORY:
        return [d for d in devs if d.name == "CPU"] or devs
    return devs


def _wrap(rec: _Received, typ: GGMLType, ne: tuple[int, ...], nb: tuple[int, ...] | None,
          dev: Device, name: str) -> tuple[Tensor | None, str]:  # fmt: skip
    """The received memory as a tensor of ``dev``'s buffer type, not copied; else (None, why)."""
    if rec.readonly:
        return None, "the array is read-only"
    if nb == ():
        return None, "its strides are negative or zero"
    t = Tensor(typ, ne, nb, name=name, ndim=rec.ndim)
    if t.nbytes == 0:
        return None, "it is empty"
    if rec.ptr % typ.type_size:
        return None, f"its address is not aligned to its {typ.type_size}-byte elements"
    buft = dev.buffer_type
    if buft.alloc_size(t) > t.nbytes:
        return None, f"{buft.name} pads tensors"
    buf = buft.from_dlpack(DLPackMemory(rec.device[0], rec.device[1], rec.ptr, rec), t.nbytes)
    if buf is None:
        return None, f"{buft.name} buffers cannot address {rec.where()} memory"
    buf.place(t, 0)
    return t, ""


def from_dlpack(x: Any, /, *, device: Any = None, copy: Any = None, ctx: Any = None,
                name: str = "") -> Tensor:  # fmt: skip
    """An accelplane tensor of the array ``x`` (any object with ``__dlpack__``: numpy, torch,
    CuPy, dpnp arrays, accelplane tensors), in a buffer of ``device`` (a Device or a device name).

    Zero-copy when ``copy`` is not True and the device's buffer type addresses the array's memory
    as it lies (host memory for the CPU device, the same GPU for CUDA, USM of the same SYCL context:
    docs/interop.md); the buffer then keeps the producer's memory alive, and writes are seen both
    ways. Otherwise a contiguous copy in a new buffer of the device (DLPackError with
    ``copy=False``). ``device=None``: the CPU device for host memory, else the first device that
    addresses the memory. The tensor is listed in Context ``ctx`` when given.

    Raises TypeMismatchError for an object that is not a DLPack producer, DLPackError for a type
    accelplane has none for or a copy ``copy=False`` forbids, ShapeError past 4 dimensions."""
    copy = _check_copy(copy, "from_dlpack")
    if not hasattr(x, "__dlpack__"):
        raise TypeMismatchError(f"from_dlpack: a {type(x).__name__} is not a DLPack producer (no __dlpack__)")
    dev = _target(device)
    if ctx is not None and not isinstance(getattr(ctx, "tensors", None), list):
        raise TypeMismatchError(f"from_dlpack: ctx must be a Context, got {type(ctx).__name__}")
    rec = _ask(x, copy)
    try:
        typ, ne, nb = _layout(rec, name)
    except Exception:
        rec.release()  # the producer's memory is not kept for the error's traceback
        raise
    t, why = None, "no device"
    for d in [dev] if dev is not None else _devices_for(rec):
        t, why = _wrap(rec, typ, ne, nb, d, name)
        if t is not None:
            dev = d
            break
    if t is not None and copy is True:  # a copy on the device, of the memory wrapped as it lies
        wrapped, t = t, _device_copy(t, t.buffer)
        wrapped.buffer.free()  # the producer's deleter runs once nothing holds its memory
    elif t is None:
        if copy is False:
            where = f"into {dev.name} " if dev is not None else ""
            raise DLPackError(f"from_dlpack {name!r}: {rec.where()} memory cannot be imported {where}"
                              f"without a copy ({why}), and copy=False")  # fmt: skip
        if dev is None:
            if rec.device[0] not in HOST_MEMORY:
                raise DLPackError(f"from_dlpack {name!r}: no accelplane device addresses {rec.where()} "
                                  "memory; pass device= to copy it into one")  # fmt: skip
            dev = _devices_for(rec)[0]
        if rec.device[0] not in HOST_MEMORY:  # ask the producer for host memory
            where = rec.where()
            rec.release()
            rec = _ask(x, None, (int(DLDeviceType.CPU), 0))
            typ, ne, nb = _layout(rec, name)
            if rec.device[0] not in HOST_MEMORY:
                raise DLPackError(f"from_dlpack {name!r}: asked for host memory, the producer gave "
                                  f"{rec.where()} (from {where})")  # fmt: skip
        t = _host_copy(rec, typ, ne, dev, name)
    if ctx is not None:
        ctx.tensors.append(t)
    return t


def _host_copy(rec: _Received, typ: GGMLType, ne: tuple[int, ...], dev: Device, name: str) -> Tensor:
    """A contiguous copy of host memory into a new buffer of ``dev``."""
    t = Tensor(typ, ne, name=name, ndim=rec.ndim)
    buf = dev.buffer_type.alloc(dev.buffer_type.alloc_size(t), BufferUsage.ANY)
    buf.place(t, 0)
    if t.nelements:
        size = typ.type_size
        strides = None if rec.strides is None else tuple(s * size for s in rec.strides)
        src = np.asarray(_Span(rec.ptr, rec.shape, strides, f"<u{size}", rec))
        t.set_bytes(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
    return t


_tensor.DLPACK = sys.modules[__name__]  # Tensor.__dlpack__ / __dlpack_device__ delegate here
