"""How a result is held against the float64 oracle: ggml's NMSE, and the NaN and infinity
rules of the conformance suite (no NaN where the oracle has none, infinities matching in sign,
exact equality for integer results)."""

from __future__ import annotations

import numpy as np


def nmse(expected: np.ndarray, got: np.ndarray) -> float:
    """Σ(got−exp)² / Σexp² (ggml's metric); the plain squared error when exp is all zero."""
    e = np.asarray(expected, np.float64).ravel()
    g = np.asarray(got, np.float64).ravel()
    num = float(np.sum((g - e) ** 2))
    den = float(np.sum(e * e))
    return num / den if den > 0 else num


def compare(expected: np.ndarray, got: np.ndarray, thr: float, exact: bool) -> tuple[bool, float, str]:
    """(ok, error, message) for one result against the oracle."""
    if expected.shape != got.shape:
        return False, float("inf"), f"shape {got.shape} != expected {expected.shape}"
    if exact:
        bad = np.argwhere(expected != got)
        if bad.size:
            i = tuple(bad[0])
            return False, float(len(bad)), (
                f"{len(bad)} of {expected.size} values differ; first at {i}: "
                f"got {got[i]}, expected {expected[i]}"
            )
        return True, 0.0, ""
    g = got.astype(np.float64)
    nan_bad = np.isnan(g) & ~np.isnan(expected)
    if nan_bad.any():
        i = tuple(np.argwhere(nan_bad)[0])
        return False, float("nan"), f"NaN at {i} where the oracle has {expected[i]!r}"
    inf_e = np.isinf(expected) | (np.abs(expected) >= np.finfo(np.float32).max)
    inf_g = np.isinf(g) | (np.abs(g) >= np.finfo(np.float32).max)
    if (inf_e != inf_g).any() or (np.sign(expected[inf_e]) != np.sign(g[inf_e])).any():
        i = tuple(np.argwhere((inf_e != inf_g) | (inf_e & (np.sign(expected) != np.sign(g))))[0])
        return False, float("inf"), f"infinity mismatch at {i}: got {g[i]}, expected {expected[i]}"
    fin = np.isfinite(expected) & ~inf_e
    err = nmse(expected[fin], g[fin])
    if not err <= thr:
        d = np.abs(np.where(fin, g - expected, 0))
        i = tuple(np.unravel_index(np.argmax(d), d.shape))
        return False, err, (
            f"NMSE {err:.3g} > {thr:.3g}; worst at {i}: got {g[i]:.6g}, expected {expected[i]:.6g}"
        )
    return True, err, ""
