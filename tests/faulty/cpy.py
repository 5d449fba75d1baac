"""faulty_cpy: the asynchronous test device, whose cpy_tensor_async returns True at once but
copies only at the destination backend's next synchronize, after everything queued on its
stream has run: work ordered after the copy reads the old destination, every time."""

from accelplane.interface import hookimpl
from accelplane.testing import asyncdev as _base
from accelplane.testing.asyncdev import *  # noqa: F403

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_CPY")


@hookimpl
def cpy_tensor_async(backend_src, backend_dst, src, dst):
    if not _base._is_ours(dst.buffer) or dst.buffer.ctx.device is not backend_dst.device:
        return False
    d = _base._bytes(dst)
    if _base._is_ours(src.buffer):
        s = _base._bytes(src)
    elif src.buffer.is_host:
        s = src.buffer.host_array[src.offs : src.offs + src.nbytes]
    else:
        return False
    # deferred deterministically (a timer thread raced the stream's random delays)
    backend_dst.ctx.__dict__.setdefault("late_copies", []).append((d, s))
    return True


@hookimpl
def synchronize(backend):
    backend.ctx.stream.synchronize()
    for d, s in backend.ctx.__dict__.pop("late_copies", []):
        d[...] = s
