"""faulty_event: the asynchronous test device, whose event_wait does not wait (a no-op)."""

from accelplane.interface import hookimpl
from accelplane.testing import asyncdev as _base
from accelplane.testing.asyncdev import *  # noqa: F403

from . import renamed


@hookimpl
def get_devices():
    return renamed(_base.get_devices(), "FAULTY_EVENT")


@hookimpl
def event_wait(backend, event):
    pass  # later work on backend does not wait for the event
