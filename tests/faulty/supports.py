"""faulty_supports: the CPU plugin, whose supports_op says yes to every ARGSORT, but whose
ARGSORT sorts ascending when asked for descending order."""

import numpy as np
from accelplane.core.ops import Op, SortOrder
from accelplane.cpu import plugin as _base
from accelplane.cpu.plan import host_view
from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.interface import hookimpl

from . import renamed


def wrong_desc(op) -> bool:
    return op.op is Op.ARGSORT and op.op_params[0] == SortOrder.DESC


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_SUPPORTS")


@hookimpl
def graph_compute(backend, graph):
    _base.graph_compute(backend, graph)
    for n in graph.nodes:
        if wrong_desc(n):
            host_view(n)[...] = np.argsort(host_view(n.src[0]), axis=-1, kind="stable")
