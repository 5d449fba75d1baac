"""Peers measured in the same run as accelplane's CUDA benchmarks, with CuPy alone:
device-to-device copy bandwidth, cuBLAS (cupy.matmul) GEMM and mat-vec.

    python -m accelplane_cuda.peers [--json FILE]
"""

from __future__ import annotations

import argparse
import json


def _time(fn, reps: int = 20) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, timed with CUDA events after a warm-up."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def measure(m: int = 4096, k: int = 14336) -> dict:
    import cupy as cp

    out: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    n_bytes = 2 << 30
    src = cp.empty(n_bytes, cp.uint8)
    dst = cp.empty_like(src)
    t = _time(lambda: cp.copyto(dst, src), 10)
    out["d2d_copy_TBps"] = 2 * n_bytes / t / 1e12  # bytes read + written
    src = dst = None
    for dt, name in ((cp.float16, "f16"), (cp.float32, "f32")):
        a = cp.random.random((m, k), dtype=cp.float32).astype(dt)
        for n in (1, 512):
            b = cp.random.random((n, k), dtype=cp.float32).astype(dt)
            t = _time(lambda a=a, b=b: cp.matmul(b, a.T))
            out[f"cublas_{name}_n{n}_us"] = t * 1e6
            out[f"cublas_{name}_n{n}_TFLOPS"] = 2 * m * n * k / t / 1e12
            if n == 1:
                out[f"cublas_{name}_n1_weight_TBps"] = a.nbytes / t / 1e12
        del a
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    res = measure()
    for k, v in res.items():
        print(f"{k:<32} {v:.3f}" if isinstance(v, float) else f"{k:<32} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
