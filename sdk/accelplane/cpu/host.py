"""The host as the CPU plugin describes it: the CPU's name, the CPUs this process may run on,
the memory. Cheap and free of heavy imports: device discovery calls it."""

from __future__ import annotations

import os


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (``taskset``, a
    container's cpuset), else every CPU. More threads than these only queue behind each other."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


def memory() -> tuple[int, int]:
    """(available, total) bytes of host memory from /proc/meminfo; (0, 0) where it cannot be read."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)
    except (OSError, ValueError):
        return 0, 0
