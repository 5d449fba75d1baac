"""honest_supports: faulty_supports's wrong descending ARGSORT, but its supports_op says no
to it: the suite must report those cases "not supported", never failed."""

from accelplane.interface import hookimpl

from . import renamed
from .supports import *  # noqa: F403
from .supports import _base, wrong_desc


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "HONEST_SUPPORTS")


@hookimpl
def supports_op(device, op):
    return _base.supports_op(device, op) and not wrong_desc(op)
