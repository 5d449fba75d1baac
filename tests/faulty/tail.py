"""faulty_tail: the CPU plugin, except that ADD gets the last element of every output row
wrong (+1) when rows have more than one element: a vector loop's tail bug."""

from accelplane.core.ops import Op
from accelplane.cpu import plugin as _base
from accelplane.cpu.plan import host_view
from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.interface import hookimpl

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_TAIL")


@hookimpl
def graph_compute(backend, graph):
    _base.graph_compute(backend, graph)
    for n in graph.nodes:
        if n.op is Op.ADD and n.ne[0] > 1:
            v = host_view(n)
            v[..., -1] += 1
