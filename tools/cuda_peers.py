"""Peers measured in the same run as accelplane's CUDA benchmarks: with CuPy alone,
device-to-device copy bandwidth, the time to merely read a mat-vec's weights, cuBLAS
(cupy.matmul) GEMM and mat-vec, and the same cuBLAS GEMM in BF16; with PyTorch (where
installed), torch.distributed's NCCL all-reduce over N GPUs, one process per GPU, for
``accelplane bench tp --peer-json``.

    python tools/cuda_peers.py [--json FILE]
    python tools/cuda_peers.py --allreduce N [--sizes 4K,1M,1G] [--dtype float32] [--json FILE]

Benchmark tooling for GPU machines (scripts/gpu-run runs it); not part of any package.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


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


# the cheapest kernel that reads every byte: four 16-byte streaming loads in flight per thread
_READ_SRC = r"""
extern "C" __global__ void read_all(const uint4* __restrict__ p, long long n, unsigned* out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    unsigned a = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 v0 = __ldcs(p + i), v1 = __ldcs(p + i + stride);
        const uint4 v2 = __ldcs(p + i + 2 * stride), v3 = __ldcs(p + i + 3 * stride);
        a ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
    }
    for (; i < n; i += stride) a ^= __ldcs(p + i).x;
    if (a == 0x9e3779b9u) out[0] = a;  // keeps the loads; practically never taken
}
"""


def read_time(nbytes: int, copies: int = 8) -> float:
    """Seconds to read ``nbytes`` once with no arithmetic (``read_all``): the ceiling for a
    memory-bound kernel of that size, launch and ramp-up included. Cycles through ``copies``
    buffers so that the 50 MiB L2 cannot serve repeats."""
    import cupy as cp
    import numpy as np

    kern = cp.RawKernel(_READ_SRC, "read_all")
    n16 = nbytes // 16
    bufs = [cp.ones(n16 * 16, cp.uint8) for _ in range(copies)]
    sink = cp.zeros(1, cp.uint32)
    grid = (4 * cp.cuda.Device().attributes["MultiProcessorCount"],)

    # captured as one CUDA graph of 4 rounds: a launch from Python takes longer than the kernel
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(4):
            for b in bufs:
                kern(grid, (512,), (b, np.int64(n16), sink))
        graph = stream.end_capture()

    graph.launch(stream)  # warm-up
    stream.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            graph.launch(stream)
        stream.synchronize()
        best = min(best, (time.perf_counter() - t0) / 10)
    return best / (4 * copies)


def measure(m: int = 4096, k: int = 14336) -> dict:
    import cupy as cp

    out: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    n_bytes = 2 << 30
    src = cp.empty(n_bytes, cp.uint8)
    dst = cp.empty_like(src)
    t = _time(lambda: cp.copyto(dst, src), 10)
    out["d2d_copy_TBps"] = 2 * n_bytes / t / 1e12  # bytes read + written
    src = dst = None
    # the weights of an m x k mat-vec per type, read with no arithmetic: the mat-vec's ceiling
    for name, nbytes in (("f16", m * k * 2), ("q8_0", m * k // 32 * 34), ("q4_0", m * k // 32 * 18)):
        t = read_time(nbytes)
        out[f"read_{name}_us"] = t * 1e6
        out[f"read_{name}_pct_of_copy"] = 100 * nbytes / t / 1e12 / out["d2d_copy_TBps"]
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
    t = _bf16_gemm_time(m, 512, k)
    out["cublas_bf16_n512_us"] = t * 1e6
    out["cublas_bf16_n512_TFLOPS"] = 2 * m * 512 * k / t / 1e12
    return out


def _bf16_gemm_time(m: int, n: int, k: int) -> float:
    """cupy.matmul's BF16 GEMM, had CuPy a bfloat16 dtype (it has none): the same cuBLAS call it
    makes for F16 (cublasGemmEx, FP32 compute, output in the inputs' type) on BF16 bits held in
    uint16 arrays; C[n, m] = B[n, k] · A[m, k]ᵀ."""
    import cupy as cp
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    def bf16(shape):  # the high halves of uniform F32 values
        return (cp.random.random(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    a, b, c = bf16((m, k)), bf16((n, k)), cp.empty((n, m), cp.uint16)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    handle = cp.cuda.device.get_cublas_handle()
    r16bf = 14  # CUDA_R_16BF

    def gemm() -> None:
        cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
        cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k, one.ctypes.data, a.data.ptr,
                      r16bf, k, b.data.ptr, r16bf, k, zero.ctypes.data, c.data.ptr, r16bf, m,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)  # fmt: skip

    return _time(gemm)


def _allreduce_rank(rank: int, n: int, sizes: list[int], dtype: str, min_time: float, store: str,
                    result: str) -> None:  # fmt: skip
    """One rank of :func:`torch_allreduce` (a spawned process)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=n,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    rows = []
    try:
        ty = getattr(torch, dtype)
        es = torch.empty(0, dtype=ty).element_size()
        for size in sizes:
            t = torch.zeros(max(1, size // es), dtype=ty, device="cuda")
            for _ in range(3):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            # every rank must run the same count: rank 0's calibration decides
            per_call = max((time.perf_counter() - t0) / 5, 1e-7)
            k = torch.tensor([max(5, int(min_time / per_call))], device="cuda")
            dist.broadcast(k, 0)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(int(k.item())):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            sec = (time.perf_counter() - t0) / int(k.item())
            nbytes = t.numel() * es
            rows.append({"algorithm": "torch.distributed", "n": n, "dtype": dtype, "bytes": nbytes,
                         "runs": int(k.item()), "us_per_call": sec * 1e6,
                         "busbw_gbps": 2 * (n - 1) / n * nbytes / sec / 1e9})  # fmt: skip
            del t
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(result, "w") as f:
            json.dump(rows, f)


def torch_allreduce(n: int, sizes: list[int], dtype: str = "float32", min_time: float = 0.2) -> list[dict]:
    """Bus bandwidth (nccl-tests' 2(n-1)/n × bytes / time) of torch.distributed's NCCL
    all-reduce over GPUs 0..n-1, one spawned process per GPU, per size in bytes."""
    import torch.multiprocessing as mp

    # multicast (NVLS) stays off, as in the plugin's own NCCL comm: on shared hosts it can take
    # the GPUs out of service
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as d:
        store, result = os.path.join(d, "store"), os.path.join(d, "rows.json")
        mp.spawn(_allreduce_rank, args=(n, sizes, dtype, min_time, store, result), nprocs=n, join=True)
        with open(result) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--allreduce", type=int, metavar="N", help="torch.distributed all-reduce over N GPUs")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M,256M,1G", help="all-reduce sizes in bytes")
    p.add_argument("--dtype", default="float32", help="all-reduce element type (torch name)")
    args = p.parse_args()
    if args.allreduce:
        from accelplane.bench import parse_sizes

        rows = torch_allreduce(args.allreduce, parse_sizes(args.sizes), args.dtype)
        print(f"{'n':>2} {'dtype':<9} {'bytes':>11} {'us/call':>10} {'busbw GB/s':>11}")
        for r in rows:
            print(f"{r['n']:>2} {r['dtype']:<9} {r['bytes']:>11} {r['us_per_call']:>10.1f} "
                  f"{r['busbw_gbps']:>11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"peer": "torch.distributed (NCCL)", "rows": rows}, f, indent=1)
        return
    res = measure()
    for k, v in res.items():
        print(f"{k:<32} {v:.3f}" if isinstance(v, float) else f"{k:<32} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
