"""The next token from a row of logits: greedy, or sampled (top-k, top-p, temperature) from a
seeded numpy generator, in the order of llama.cpp's default sampler chain."""

from __future__ import annotations

import math

import numpy as np

from accelplane.errors import ConfigError, ShapeError


class Sampler:
    """Picks token ids from logits. ``temp`` <= 0: greedy (the largest logit; the lowest id on a
    tie). Otherwise, as llama.cpp chains them: keep the ``top_k`` largest logits (0: all), then
    the fewest of those, largest first, whose probabilities (softmax at temperature 1) reach
    ``top_p`` (1: all), then draw from the softmax of the kept logits divided by ``temp``. The
    draws come from ``numpy.random.default_rng(seed)``: the same seed and logits give the same
    ids. ConfigError for a value outside its range."""

    def __init__(self, temp: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int = 0) -> None:
        if not (isinstance(temp, int | float) and math.isfinite(temp)):
            raise ConfigError(f"sampling temperature must be a finite number, got {temp!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ConfigError(f"top-k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
        if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
            raise ConfigError(f"top-p must be a number in (0, 1], got {top_p!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"sampling seed must be an integer >= 0, got {seed!r}")
        self.temp, self.top_k, self.top_p, self.seed = float(temp), top_k, float(top_p), seed
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) the next token is drawn from, largest first (float64)."""
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if x.size == 0:
            raise ShapeError("sampling: an empty row of logits")
        ids = np.arange(x.size)
        if 0 < self.top_k < x.size:
            ids = np.argpartition(-x, self.top_k - 1)[: self.top_k]
        ids = ids[np.lexsort((ids, -x[ids]))]  # largest first, the lower id first on a tie
        if self.top_p < 1:
            p = _softmax(x[ids])
            keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1  # the one that reaches top_p too
            ids = ids[: max(1, min(keep, ids.size))]
        return ids, _softmax(x[ids] / self.temp)

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id."""
        if self.greedy:
            x = np.asarray(logits).reshape(-1)
            if x.size == 0:
                raise ShapeError("sampling: an empty row of logits")
            return int(np.argmax(x))
        ids, p = self.candidates(logits)
        c = np.cumsum(p)
        k = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(ids[min(k, ids.size - 1)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


__all__ = ["Sampler"]
