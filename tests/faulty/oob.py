"""faulty_oob: the CPU plugin, except that MUL writes one 4-byte element past the end of its
output tensor (the bytes at [offs + nbytes, offs + nbytes + 4) of the buffer)."""

from accelplane.core.ops import Op
from accelplane.cpu import plugin as _base
from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.interface import hookimpl

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_OOB")


@hookimpl
def graph_compute(backend, graph):
    _base.graph_compute(backend, graph)
    for n in graph.nodes:
        if n.op is Op.MUL:
            mem = n.buffer.host_array
            end = n.offs + n.nbytes
            mem[end : end + 4] = ~mem[end : end + 4]  # garbage that surely differs
