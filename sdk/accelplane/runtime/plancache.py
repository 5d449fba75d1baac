"""Plans cached per graph: what every plugin needs so that a repeated graph costs no
re-planning (ggml's Hexagon graph cache, CUDA graphs). A plan is rebuilt when the graph's
``layout_version`` changed (the allocator moved its tensors)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelplane import env


class PlanCache:
    """graph → plan, held weakly (a dropped graph drops its plan). ``builds`` counts the
    plans made, so tests can check that an unchanged graph is not prepared again."""

    def __init__(self, build: Callable[[Any], Any]) -> None:
        self._build = build
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.builds = 0

    def get(self, graph) -> Any:
        entry = self._plans.get(graph)
        if entry is not None and entry[0] == graph.layout_version:
            return entry[1]
        plan = self._build(graph)
        self.builds += 1
        self._plans[graph] = (graph.layout_version, plan)
        return plan

    def clear(self) -> None:
        self._plans.clear()


def cache_dir(*parts: str) -> Path:
    """A per-user cache directory for compiled kernels and similar artefacts:
    $ACCELPLANE_CACHE_DIR, else $XDG_CACHE_HOME/accelplane, else ~/.cache/accelplane."""
    base = env.CACHE_DIR.get()
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "accelplane")
    p = Path(base, *parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
