"""The multi-backend scheduler (:mod:`.scheduler`): assignment, splits, copies, events and the
synchronization policies of docs/ordering.md."""

from accelplane.sched.scheduler import GraphRunner, Scheduler

__all__ = ["GraphRunner", "Scheduler"]
