"""faulty_round_even: the CPU plugin, except that ROUND rounds halves to even (numpy's np.round,
IEEE's default) instead of away from zero as ggml's roundf does: 2.5 -> 2, -0.5 -> -0."""

import numpy as np
from accelplane.core.ops import Op, UnaryOp
from accelplane.cpu import plugin as _base
from accelplane.cpu.plan import host_view
from accelplane.cpu.plugin import *  # noqa: F403
from accelplane.interface import hookimpl

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_ROUND_EVEN")


@hookimpl
def graph_compute(backend, graph):
    _base.graph_compute(backend, graph)
    for n in graph.nodes:  # the suite's layouts never compute a node in place of its source
        if n.op is Op.UNARY and n.op_params[0] == UnaryOp.ROUND:
            host_view(n)[...] = np.round(host_view(n.src[0]).astype(np.float32))
