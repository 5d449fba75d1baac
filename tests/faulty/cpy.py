"""faulty_cpy: the asynchronous test device, whose cpy_tensor_async returns True at once and
copies later, on a thread of its own after a short delay, ordered with neither stream."""

import os
import threading
import time

from accelplane.hookspecs import hookimpl
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
    # twice the streams' largest random delay (at least 1 ms): the copy usually lands after
    # the destination stream has already read dst
    delay = max(2e-6 * float(os.environ.get("ACCELPLANE_TEST_DELAY_US", "100")), 1e-3)

    def late_copy() -> None:
        time.sleep(delay)
        d[...] = s

    threading.Thread(target=late_copy, name="faulty-late-copy", daemon=True).start()
    return True
