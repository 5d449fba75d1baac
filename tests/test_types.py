"""accelplane.core.types: (de)quantization against ggml's reference and gguf-py.

The types gguf.quants can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are compared byte for byte
with it (itself bit-exact with ggml); every quantized type with ggml's C reference output
(quantize_row_<type>_ref: digests on a fixed input, and the bytes of tests/data/ggml_quant_ref.npz,
which tools/ggml_reference.py made through ggml's library), and through round-trip error bounds.
Dequantizers must be bit-identical to gguf.quants.dequantize.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from accelplane.core.types import GGMLType, dequantize, quantize, row_size
from accelplane.errors import ShapeError, TypeMismatchError
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

T = GGMLType
GGUF_QUANTIZES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # the types gguf.quants quantizes
QUANT_TYPES = [*GGUF_QUANTIZES, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
SEARCH_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]  # quantizers with a scale search
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
GQ = {t: gguf.GGMLQuantizationType(int(t)) for t in [*QUANT_TYPES, *FLOAT_TYPES]}


def bits(a: np.ndarray) -> np.ndarray:
    """float32 array as uint32 bits, so NaNs and signed zeros compare exactly."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def gauss(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def edge_rows(seed: int, nrows: int, ne0: int) -> np.ndarray:
    """Gaussian rows with an all-zero row, zero blocks, large outliers and a tiny-scale row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((nrows, ne0)).astype(np.float32)
    x[0] = 0
    if nrows > 1:
        x[1, ::13] = 1e4  # outliers
        x[1, 5] = -3e4
    if nrows > 2:
        x[2, :32] = 0
        x[2] *= np.float32(1e-6)
    if nrows > 3:
        x[3] = np.round(x[3] * 4) / 4  # many exact ties
    if nrows > 4:
        x[4] = (np.arange(ne0) % 32 - 16) + 0.5  # Q8_0 d = 1 and x*id = k + 0.5: roundf ties
        x[4, ::32] = 127
    return x


def random_blocks(t: GGMLType, n: int, seed: int) -> np.ndarray:
    """n random byte-valid blocks of t: finite f16 scales, random quants and scale bytes."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, t.type_size), dtype=np.uint8)
    for off in t.traits.f16_fields:  # checked against gguf by test_traits_match_gguf
        h = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0xBFFF, h)  # inf/nan -> finite
        b[:, off : off + 2] = h.astype("<u2").view(np.uint8).reshape(n, 2)
    return b


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py: random scale bytes hold NaNs
@pytest.mark.parametrize("t", list(T), ids=str)
def test_traits_match_gguf(t: GGMLType) -> None:
    """Ids and sizes are gguf's; a block's f16 fields are its scales: zeroed, the rest random,
    every value dequantizes to 0 (with random bytes there, practically never)."""
    gq = gguf.GGMLQuantizationType[t.name]
    assert int(gq) == int(t)
    assert gguf.GGML_QUANT_SIZES[gq] == (t.blck_size, t.type_size)
    if not t.is_quantized:
        return
    b = np.random.default_rng(int(t)).integers(0, 256, (64, t.type_size), dtype=np.uint8)
    assert np.any(gguf.quants.dequantize(b, gq) != 0)
    for off in t.traits.f16_fields:
        b[:, off : off + 2] = 0
    np.testing.assert_array_equal(gguf.quants.dequantize(b, gq), 0)


# ---- the types gguf-py quantizes ----------------------------------------------------------


@pytest.mark.parametrize("t", GGUF_QUANTIZES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("nrows", [1, 3, 7])
def test_quantize_matches_gguf(t: GGMLType, seed: int, nrows: int) -> None:
    for x in (gauss(seed, (nrows, 96)), edge_rows(seed, nrows, 320)):
        ours = quantize(t, x)
        assert ours.dtype == np.uint8 and ours.shape == (nrows, row_size(t, x.shape[1]))
        np.testing.assert_array_equal(ours, gguf.quants.quantize(x, GQ[t]))


ALL_MAGNITUDES = (1e-30, 1e-12, 1e-4, 1.0, 3.0, 1e4, 1e8, 1e20)  # tiny, f16-subnormal, f16-overflowing


@st.composite
def block_rows(draw: st.DrawFn, blck: int, magnitudes: tuple[float, ...] = ALL_MAGNITUDES) -> np.ndarray:
    """Rows of 1..3 blocks at one of ``magnitudes``, some rows all zero or constant (a quarter
    of the magnitude or more), some blocks sparse."""
    nrows, nb = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    x = draw(hnp.arrays(np.float32, (nrows, nb * blck),
                        elements=st.floats(-1, 1, width=32, allow_subnormal=False)))  # fmt: skip
    scale = np.float32(draw(st.sampled_from(magnitudes)))
    x = x * scale
    for r in range(nrows):
        kind = draw(st.sampled_from(["as is", "zero", "constant", "sparse"]))
        if kind == "zero":
            x[r] = 0
        elif kind == "constant":
            x[r] = np.float32(draw(st.sampled_from([-1.0, -0.25, 0.25, 0.6, 1.0]))) * scale
        elif kind == "sparse":
            x[r, draw(st.integers(0, nb * blck - 1)) :] = 0
    return x + np.float32(0)  # -0.0 -> +0.0: gguf differs from ggml on blocks of -0.0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py: f16 overflow of d
@settings(max_examples=150, deadline=None)
@given(t=st.sampled_from(GGUF_QUANTIZES), data=st.data())
def test_quantize_matches_gguf_hypothesis(t: GGMLType, data: st.DataObject) -> None:
    x = data.draw(block_rows(t.blck_size))
    np.testing.assert_array_equal(quantize(t, x), gguf.quants.quantize(x, GQ[t]))


def test_zero_blocks_match_ggml() -> None:
    # ggml's Q4_0/Q5_0 scan |x| from max = +0, so d = +0 / -8 = -0 (0x8000), also for -0.0
    # input; Q4_1/Q5_1 keep the first element as the min: m = -0 for a block of -0.0
    for z in (np.zeros((1, 32), np.float32), np.full((1, 32), -0.0, np.float32)):
        m = b"\x00\x80" if np.signbit(z[0, 0]) else b"\x00\x00"
        assert quantize(T.Q4_0, z).tobytes() == b"\x00\x80" + bytes([0x88] * 16)
        assert quantize(T.Q8_0, z).tobytes() == bytes(34)
        assert quantize(T.Q4_1, z).tobytes() == bytes(2) + m + bytes(16)
        assert quantize(T.Q5_0, z).tobytes() == b"\x00\x80" + bytes([0xFF] * 4) + bytes(16)
        assert quantize(T.Q5_1, z).tobytes() == bytes(2) + m + bytes(20)
        assert quantize(T.Q6_K, np.zeros((1, 256), np.float32)).tobytes() == bytes(210)


# ---- every block type vs ggml's C reference ------------------------------------------------


def golden_input() -> np.ndarray:
    """Platform-independent float32 [48, 2048] input (PCG64 raw bits, exact float ops).

    ~Gaussian rows plus rows that reach ggml's corner cases: zero/constant/one-signed blocks,
    outliers, exact rounding ties, sub-blocks whose 6-bit scale rounds to 0, subnormal and
    overflowing (x*x = inf) magnitudes.
    """
    nrows, ne0 = 48, 2048
    raw = np.random.PCG64(20240601).random_raw(4 * nrows * ne0)
    u = (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)
    u = u.reshape(4, nrows, ne0)
    x = ((u[0] + u[1]) + (u[2] + u[3]) - np.float32(2)) * np.float32(1.7)
    j = np.arange(ne0)
    x[0, :256] = 0
    x[1, :32] = 0
    x[2, 256:512] = 5.0
    x[3, 17] = 100.0
    x[4] *= np.float32(1e-4)
    x[5, 512:768] = -np.abs(x[5, 512:768])
    x[6] = np.round(x[6] * np.float32(4)) / np.float32(4)
    x[7, 768:] = np.abs(x[7, 768:]) + np.float32(1)
    x[8] = (j % 32 - 16).astype(np.float32) + np.float32(0.5)  # Q8_0 d = 1: x*id ties at .5
    x[8, ::32] = 127
    x[9] = np.ldexp(x[9], -(raw[: ne0 // 16] % 24).astype(np.int32).repeat(16))  # tiny sub-blocks
    x[10] *= np.float32(1e-41)
    x[11] *= np.float32(1e-37)
    x[12] *= np.float32(1e20)
    x[13, (raw[ne0 : 2 * ne0] % 8 != 0)] = 0
    return x


GOLDEN_INPUT_SHA256 = "dcf046ccc03e208d59749ad62609adcb686eccbe42997431359c80670c84bff2"
# sha256 of ggml's quantize_row_<type>_ref output for golden_input() (ggml-base, x86-64, no FMA)
GOLDEN_SHA256 = {
    T.Q8_0: "af291ce4a7e2cbb223d34d1433e67b87024218b75b4f7a342c7576c5f6b42746",
    T.Q4_0: "885011c1e1a6c561a6f5c9c58724dfe4d4da391c87567090b92c4e8b93975283",
    T.Q4_K: "3ca62f3a6888e345aa0f48734663de943b932d031954ef3d52f4d9b401100f3c",
    T.Q6_K: "70733d1dbd51e5f91759ab47a4fefb8137df896d47bc6940171e527e334c5824",
    T.Q4_1: "8b1c506f8220295b61da576a4c03b138bd2aa4c2d6e2b1a1795ded337ada1c36",
    T.Q5_0: "52b2cbf04f95173d26ee6badcd8f5aec3118d75edc7b282eed6a2f27021897e6",
    T.Q5_1: "b1f1d12b1cc97407f8fc0c22665c149569e038a09303c6e4db93f5db18abd927",
    T.Q2_K: "8bea258e0419ef3af8e03abb0c02cbe3d93d200ce3d2789b800536c77c69e248",
    T.Q3_K: "38285e10e4f169422eb2ff9207d330bcadcbea5c52fc09d5c2c00542fa9d668e",
    T.Q5_K: "92bf9e1041bb6a29c22f31b010657f03acbd706814be48ac52024a205e5930cc",
    T.IQ4_NL: "c54893e5ee99bca6edb70d2b9f54991a0d03d43c6358caf37c1e540358eb7678",  # see undefined_quants
    T.IQ4_XS: "2a6bc7b1fa1af5beba31855736e8efa7ad03e5d9c1d255129ba081696e4bce94",
}


def undefined_quants(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """bool [rows, blocks]: the blocks whose quant bytes ggml's reference leaves undefined.
    IQ4_NL's skips a block of |x| < 1e-15 (d = 0) without writing its quants buffer: the block
    repeats the quants of the one before it, and before any other block of the row they are
    whatever memory held (ours write 0; the digest above is of ggml's output with those 0)."""
    if t != T.IQ4_NL:
        return np.zeros((x.shape[0], x.shape[1] // t.blck_size), bool)
    zero = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=2) < 1e-15
    return np.logical_and.accumulate(zero, axis=1)


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_quantize_matches_ggml_reference_digest(t: GGMLType) -> None:
    x = golden_input()
    assert hashlib.sha256(x.tobytes()).hexdigest() == GOLDEN_INPUT_SHA256, "input generator drift"
    q = quantize(t, x)
    assert q.shape == (48, row_size(t, 2048))
    assert hashlib.sha256(q.tobytes()).hexdigest() == GOLDEN_SHA256[t]


GGML_REF = Path(__file__).parent / "data" / "ggml_quant_ref.npz"  # tools/ggml_reference.py wrote it


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_quantize_matches_ggml_reference_file(t: GGMLType) -> None:
    """Bytes of ggml's from_float_ref (quantize_row_<type>_ref) on edge-case rows, stored with
    their input (undefined bytes aside); a mismatch names the first block that differs."""
    with np.load(GGML_REF) as ref:
        x, want = ref["x"], ref[t.traits.name].copy()
    want.reshape(x.shape[0], -1, t.type_size)[undefined_quants(t, x), 2:] = 0  # IQ4_NL's d at 0..1
    got = quantize(t, x)
    assert got.shape == want.shape
    blocks = (got != want).reshape(x.shape[0], -1, t.type_size).any(axis=2)
    if blocks.any():
        r, b = np.argwhere(blocks)[0]
        raise AssertionError(f"{t.name}: {int(blocks.sum())} blocks differ, first row {r} block {b}: "
                             f"{got[r].reshape(-1, t.type_size)[b].tobytes().hex()} != "
                             f"{want[r].reshape(-1, t.type_size)[b].tobytes().hex()}")


# rel. RMS error on N(0,1) data: ggml's ref algorithm gets ~0.071 (Q4_K), ~0.0177 (Q6_K),
# ~0.086 (Q4_0), ~0.0053 (Q8_0), ~0.080 (Q4_1), ~0.044 (Q5_0), ~0.038 (Q5_1), ~0.30 (Q2_K),
# ~0.152 (Q3_K), ~0.037 (Q5_K), ~0.079 (IQ4_NL), ~0.077 (IQ4_XS)
REL_RMS_BOUND = {T.Q4_K: 0.075, T.Q6_K: 0.0195, T.Q4_0: 0.09, T.Q8_0: 0.0056, T.Q4_1: 0.085,
                 T.Q5_0: 0.047, T.Q5_1: 0.042, T.Q2_K: 0.32, T.Q3_K: 0.16, T.Q5_K: 0.039,
                 T.IQ4_NL: 0.082, T.IQ4_XS: 0.08}  # fmt: skip
# worst |error| of an element over the greatest |x| of its block (block_rows at magnitudes 1 to
# 100): the step bound for the 32-blocks (Q4_0 d = 1/8, Q4_1 (max-min)/30 <= 1/15, Q5_0 1/16,
# Q5_1 1/31, Q8_0 1/254, each with its f16 rounding), and for the quantizers with a scale search
# ~1.15x the worst of 3000 random rows each (Q2_K 0.65, Q3_K 0.28, Q4_K 0.12, Q5_K 0.068,
# Q6_K 0.025, IQ4_NL 0.134, IQ4_XS 0.138); plus F16_SLACK for blocks of tiny values, whose f16
# scales are subnormal: their rounding (<= 2**-25) times the largest scale x quant product
# (63 * 31 * 2)
F16_SLACK = 2.5e-4
BLOCK_ERR_BOUND = {T.Q4_0: 0.13, T.Q4_1: 0.07, T.Q5_0: 0.065, T.Q5_1: 0.035, T.Q8_0: 0.005, T.Q2_K: 0.75,
                   T.Q3_K: 0.32, T.Q4_K: 0.14, T.Q5_K: 0.08, T.Q6_K: 0.03, T.IQ4_NL: 0.155,
                   T.IQ4_XS: 0.16}  # fmt: skip


@pytest.mark.parametrize("t", QUANT_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_error(t: GGMLType, seed: int) -> None:
    x = gauss(seed, (7, 1024))
    q = quantize(t, x)
    y = dequantize(t, q, 1024)
    assert y.dtype == np.float32 and y.shape == x.shape
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert rel < REL_RMS_BOUND[t], f"{t.name}: relative RMS error {rel:.4f}"
    np.testing.assert_array_equal(bits(y), bits(gguf.quants.dequantize(q, GQ[t])))


@settings(max_examples=120, deadline=None)
@given(t=st.sampled_from(QUANT_TYPES), data=st.data())
def test_round_trip_bound_hypothesis(t: GGMLType, data: st.DataObject) -> None:
    """Through gguf's dequantizer: every element within BLOCK_ERR_BOUND of its block's largest
    |x|, all-zero rows exactly zero, and our dequantizer gives the same bits."""
    x = data.draw(block_rows(t.blck_size, magnitudes=(1.0, 3.0, 100.0)))
    q = quantize(t, x)
    y = gguf.quants.dequantize(q, GQ[t])
    np.testing.assert_array_equal(bits(dequantize(t, q, x.shape[1])), bits(y))
    np.testing.assert_array_equal(y[~x.any(axis=1)], 0)
    err = np.abs(y - x).reshape(-1, t.blck_size)
    amax = np.abs(x).reshape(-1, t.blck_size).max(axis=1, keepdims=True)
    excess = float(np.max(err - amax * BLOCK_ERR_BOUND[t]))
    assert np.all(err <= BLOCK_ERR_BOUND[t] * amax + F16_SLACK), f"{t.name}: {excess}"


@pytest.mark.parametrize("t", SEARCH_TYPES)
def test_search_quant_edge_rows(t: GGMLType) -> None:
    x = edge_rows(3, 5, 512)
    q = quantize(t, x)
    y = dequantize(t, q, 512)
    np.testing.assert_array_equal(bits(y), bits(gguf.quants.dequantize(q, GQ[t])))
    np.testing.assert_array_equal(y[0], 0)  # all-zero row stays zero
    assert np.all(np.isfinite(y))
    rel = np.sqrt(np.mean((y[4] - x[4]) ** 2) / np.mean(x[4] ** 2))
    assert rel < REL_RMS_BOUND[t] * 2


def test_chunking_does_not_change_bytes() -> None:
    x = gauss(5, (600, 256))  # more blocks than one vectorized chunk (256; IQ4_NL 4096 of 32)
    for t in SEARCH_TYPES:
        whole = quantize(t, x)
        parts = np.concatenate([quantize(t, x[i : i + 7]) for i in range(0, 600, 7)])
        np.testing.assert_array_equal(whole, parts)


# ---- dequantizers vs gguf-py --------------------------------------------------------------


@pytest.mark.parametrize("t", QUANT_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_random_blocks_matches_gguf(t: GGMLType, seed: int) -> None:
    nb = 24
    b = random_blocks(t, nb, seed).reshape(3, nb // 3 * t.type_size)
    ne0 = nb // 3 * t.blck_size
    y = dequantize(t, b, ne0)
    assert y.dtype == np.float32 and y.shape == (3, ne0)
    np.testing.assert_array_equal(bits(y), bits(gguf.quants.dequantize(b, GQ[t])))


@settings(max_examples=40, deadline=None)
@given(t=st.sampled_from(QUANT_TYPES + FLOAT_TYPES), nb=st.integers(1, 6), data=st.data())
def test_dequantize_random_bytes_hypothesis(t: GGMLType, nb: int, data: st.DataObject) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    if t.is_quantized:
        b = random_blocks(t, nb, seed).reshape(1, -1)
    else:  # any bit pattern, NaNs included
        b = np.random.default_rng(seed).integers(0, 256, (1, nb * 4 * t.type_size), np.uint8)
    ne0 = b.shape[1] // t.type_size * t.blck_size
    ref = gguf.quants.dequantize(b, GQ[t]).astype(np.float32, copy=False)
    np.testing.assert_array_equal(bits(dequantize(t, b, ne0)), bits(ref.reshape(1, ne0)))


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_dequantize_own_output_matches_gguf(t: GGMLType) -> None:
    q = quantize(t, edge_rows(9, 4, 768))
    np.testing.assert_array_equal(bits(dequantize(t, q, 768)), bits(gguf.quants.dequantize(q, GQ[t])))


# ---- float types ---------------------------------------------------------------------------


def test_float_round_trips() -> None:
    x = gauss(4, (3, 5, 64)) * np.float32(1e3)
    x[0, 0, :4] = [np.inf, -np.inf, 1e-42, 70000.0]
    q32 = quantize(T.F32, x)
    assert q32.shape == (3, 5, 256)
    np.testing.assert_array_equal(dequantize(T.F32, q32, 64), x)
    with np.errstate(over="ignore"):
        x16 = x.astype(np.float16)
    q16 = quantize(T.F16, x)
    assert q16.shape == (3, 5, 128)
    np.testing.assert_array_equal(q16.view("<f2"), x16)
    np.testing.assert_array_equal(dequantize(T.F16, q16, 64), x16)
    qb = quantize(T.BF16, x)
    assert qb.shape == (3, 5, 128)
    np.testing.assert_array_equal(qb.view("<u2"), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(dequantize(T.BF16, qb, 64), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_float_types_round_to_nearest_even_like_ggml() -> None:
    u = np.random.default_rng(6).integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    u[:4] = [0x3F808000, 0x3F818000, 0x7FC12345, 0xFF812345]  # bf16 ties, quiet/signalling NaN
    x = u.view(np.float32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rne = (u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16
    want_bf16 = np.where(nan, (u >> 16) | 64, rne).astype(np.uint16)  # ggml_compute_fp32_to_bf16
    np.testing.assert_array_equal(quantize(T.BF16, x).view("<u2"), want_bf16)
    np.testing.assert_array_equal(
        quantize(T.BF16, x).view("<u2"), gguf.quants.quantize(x, GQ[T.BF16]).view(np.uint16)
    )
    h = quantize(T.F16, x).view("<u2")
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(h[~nan], x[~nan].astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(h[nan], ((u[nan] >> 16) & 0x8000) | 0x7E00)


def test_quantize_accepts_other_float_dtypes() -> None:
    x64 = np.random.default_rng(7).standard_normal((2, 256))
    for t in (T.F16, T.BF16, *QUANT_TYPES):
        np.testing.assert_array_equal(quantize(t, x64), quantize(t, x64.astype(np.float32)))
    x16 = x64.astype(np.float16)
    np.testing.assert_array_equal(quantize(T.F16, x16).view("<f2"), x16)


# ---- shapes and errors ---------------------------------------------------------------------


def test_shapes() -> None:
    x = gauss(8, (2, 3, 256))
    for t in QUANT_TYPES:
        q = quantize(t, x)
        assert q.shape == (2, 3, t.type_size * 256 // t.blck_size)
        assert dequantize(t, q, 256).shape == (2, 3, 256)
        flat = dequantize(t, q.tobytes(), 256)  # bytes-like: a flat run of whole rows
        np.testing.assert_array_equal(flat, dequantize(t, q, 256).reshape(-1))
        np.testing.assert_array_equal(dequantize(t, q[1, 2], 256), dequantize(t, q, 256)[1, 2])
        assert quantize(t, np.zeros((0, 256), np.float32)).shape == (0, row_size(t, 256))
        assert dequantize(t, np.zeros((0, row_size(t, 256)), np.uint8), 256).shape == (0, 256)
    assert quantize(T.Q4_0, np.zeros((4, 0))).shape == (4, 0)
    assert dequantize(T.Q4_0, b"", 0).shape == (0,)
    assert quantize("q8_0", x[0, 0]).shape == (272,)


@pytest.mark.parametrize("t", [T.I32, "i32", 26])
def test_i32_rejected(t: GGMLType | str | int) -> None:
    with pytest.raises(TypeMismatchError):
        quantize(t, np.zeros((1, 32), np.float32))
    with pytest.raises(TypeMismatchError):
        dequantize(t, np.zeros((1, 128), np.uint8), 32)


@pytest.mark.parametrize("t", QUANT_TYPES)
def test_shape_errors(t: GGMLType) -> None:
    bs = t.blck_size
    with pytest.raises(ShapeError, match="block size"):
        quantize(t, np.zeros((2, bs + 16), np.float32))
    with pytest.raises(ShapeError, match="block size"):
        dequantize(t, np.zeros((2, t.type_size), np.uint8), bs + 16)
    with pytest.raises(ShapeError, match="bytes"):
        dequantize(t, np.zeros((2, t.type_size + 1), np.uint8), bs)
    with pytest.raises(ShapeError, match="bytes"):
        dequantize(t, bytes(t.type_size * 3 - 1), bs)
    with pytest.raises(ShapeError):
        quantize(t, np.float32(1.0))
    with pytest.raises(ShapeError):
        dequantize(t, np.uint8(1), bs)


def test_type_errors() -> None:
    with pytest.raises(TypeMismatchError):
        quantize(T.Q8_0, np.zeros((1, 32), np.complex64))
    with pytest.raises(TypeMismatchError):
        dequantize(T.Q8_0, np.zeros((1, 17), np.float16), 32)
    with pytest.raises(TypeMismatchError):
        dequantize(T.Q8_0, 12345, 32)
    with pytest.raises(TypeMismatchError):
        quantize("iq2_xxs", np.zeros((1, 32), np.float32))
