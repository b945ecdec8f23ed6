"""quant.py against independent oracles: float64 math, math.frexp, bit-level RNE, ml_dtypes casts,
and the official trace's act_quant / fp8_gemm outputs."""
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import quant
from helpers import assert_bf16_close

F32 = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def act_quant_oracle(x):  # per 128-block with Python floats and frexp, casts by ml_dtypes
    x = np.asarray(x, np.float32)
    q = np.empty(x.shape, ml_dtypes.float8_e4m3fn)
    s = np.empty(x.shape[:-1] + (x.shape[-1] // 128,), np.float32)
    for idx in np.ndindex(*x.shape[:-1]):
        for b in range(x.shape[-1] // 128):
            blk = x[idx][b * 128:(b + 1) * 128]
            amax = max(float(np.abs(blk).max()), float(np.float32(1e-4)))
            v = float(np.float32(amax * float(np.float32(1 / 448))))     # exact double product, one fp32 rounding
            m, e = math.frexp(v)                                          # v = m 2^e, m in [0.5, 1)
            scale = 2.0 ** (e - 1 if m == 0.5 else e)                     # 2^ceil(log2 v)
            s[idx + (b,)] = scale
            q[idx][b * 128:(b + 1) * 128] = np.clip(blk.astype(np.float64) / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([128, 256, 384])), elements=F32),
       st.integers(-20, 20))
def test_act_quant_matches_oracle(x, e):
    x = x * np.float32(2.0 ** e)
    q, s = quant.act_quant(x)
    qo, so = act_quant_oracle(x)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
    np.testing.assert_array_equal(q.view(np.uint8), qo.view(np.uint8))
    np.testing.assert_array_equal(s, so)
    assert np.all(np.exp2(np.round(np.log2(s))) == s)                      # powers of two
    # within half an e4m3 step: 2^-4 relative in the normal range, 2^-10 * s below it
    err = np.abs(quant.act_dequant(q, s) - x)
    bound = np.maximum(np.abs(x) * 2.0 ** -4, np.repeat(s, 128, -1) * 2.0 ** -10)
    assert np.all(err <= bound * (1 + 1e-6))


def test_act_quant_edge_cases():
    z = np.zeros((2, 128), np.float32)
    q, s = quant.act_quant(z)
    assert np.all(s == 2.0 ** -22) and np.all(q.astype(np.float32) == 0)  # amax clamped at 1e-4
    for k in (-3, 0, 5):                                                   # amax = 448 * 2^k -> s = 2^k exactly
        x = np.zeros((1, 128), np.float32)
        x[0, 7] = 448 * 2.0 ** k
        _, s = quant.act_quant(x)
        assert s[0, 0] == 2.0 ** k
    with pytest.raises(ValueError, match="multiple of 128"):
        quant.act_quant(np.zeros((1, 100), np.float32))
    _, plain = quant.act_quant(np.full((1, 128), 3.0, np.float32), scale_fmt=None)
    assert plain[0, 0] == np.float32(3.0) * np.float32(1 / 448)


def test_act_quant_matches_official_trace(trace):
    for l in ("l0", "l1"):
        q, s = quant.act_quant(trace[f"{l}.act_quant_in"])
        np.testing.assert_array_equal(q.view(np.uint8), trace[f"{l}.act_quant_fp8_bits"])
        np.testing.assert_array_equal(s, trace[f"{l}.act_quant_scale"])


def bf16_oracle(x):  # round to nearest even on the bits
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-2.0 ** 100, 2.0 ** 100, allow_nan=False, width=32)))
def test_bf16_round_is_rne(x):
    np.testing.assert_array_equal(quant.bf16_round(x), bf16_oracle(x))


@given(st.integers(1, 300), st.integers(1, 300), st.integers(-8, 8), st.integers(0, 2 ** 31))
def test_weight_quant_roundtrip(N, K, e, seed):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * np.float32(2.0 ** e)
    q, s = quant.weight_quant(w)
    assert s.shape == (-(-N // 128), -(-K // 128))
    assert np.all(np.exp2(np.round(np.log2(s))) == s)
    for i in range(s.shape[0]):                                            # oracle: explicit per-block loop
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert np.abs(blk).max() / s[i, j] <= 448                      # nothing saturates
            want = (blk.astype(np.float64) / s[i, j]).astype(ml_dtypes.float8_e4m3fn)
            got = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
            deq = quant.weight_dequant(q, s)[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            np.testing.assert_array_equal(deq, got.astype(np.float64) * s[i, j])


def test_weight_dequant_576_rows_use_last_scale_row():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((576, 256)).astype(ml_dtypes.float8_e4m3fn)
    s = np.exp2(rng.integers(-6, 6, (5, 2))).astype(np.float32)
    d = quant.weight_dequant(q, s)
    assert np.all(d[512:, :128] == q[512:, :128].astype(np.float32) * s[4, 0])
    assert np.all(d[:128, 128:] == q[:128, 128:].astype(np.float32) * s[0, 1])


@given(st.integers(1, 9), st.integers(1, 300), st.sampled_from([128, 256, 512]), st.integers(0, 2 ** 31))
def test_fp8_gemm_matches_float64(M, N, K, seed):
    rng = np.random.default_rng(seed)
    a, sa = quant.act_quant(rng.standard_normal((M, K)).astype(np.float32) * 3)
    b, sb = quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32))
    ref = quant.act_dequant(a, sa).astype(np.float64) @ quant.weight_dequant(b, sb).astype(np.float64).T
    got = quant.fp8_gemm(a, sa, b, sb)
    # exact per-block partials, then at most K/128 fp32 additions
    assert np.abs(got - ref).max() <= (K // 128 + 1) * 2.0 ** -23 * np.abs(ref).max()


def test_linear_matches_official_trace(trace):
    import checkpoint
    from conftest import FIXTURE_CKPT
    ck = checkpoint.Checkpoint(FIXTURE_CKPT)
    for l, i in (("l0", 0), ("l1", 1)):   # the first FP8 linear of each layer is wq_a
        y = quant.linear_ref(trace[f"{l}.act_quant_in"], ck.weight(f"model.layers.{i}.self_attn.q_a_proj"), True)
        assert_bf16_close(y, trace[f"{l}.fp8_gemm_out"], what=f"{l} fp8_gemm")


def test_e4m3fnuz_reads_the_same_values():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).reshape(2, 128)
    s = np.array([[0.5]], np.float32)
    fnuz, s2 = quant.to_e4m3fnuz(codes, s)
    a = codes.astype(np.float32) * 0.5
    b = fnuz.astype(np.float32) * s2[0, 0]
    finite = np.isfinite(a)
    np.testing.assert_array_equal(a[finite], b[finite])
    assert not np.isnan(b).any() or np.isnan(a[np.isnan(b)]).all()        # only e4m3fn's own NaNs stay NaN
    q, sq = quant.act_quant(np.linspace(-300, 300, 128, dtype=np.float32)[None], fp8=quant.E4M3FNUZ)
    assert np.abs(q.astype(np.float32)).max() <= 240


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)


@given(st.integers(1, 5), st.sampled_from([32, 64, 128]), st.integers(-10, 10), st.integers(0, 2 ** 31))
def test_fp4_roundtrip(N, K, e, seed):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * np.float32(2.0 ** e)
    packed, s = quant.fp4_quant(w)
    assert packed.shape == (N, K // 2) and packed.dtype == np.uint8 and s.shape == (N, K // 32)
    for i in range(N):
        for j in range(K // 32):
            blk = w[i, j * 32:(j + 1) * 32]
            m, ex = math.frexp(float(np.abs(blk).max()))                   # amax = m 2^ex, floor(log2) = ex - 1
            assert s[i, j] == 2.0 ** (ex - 1 - 2)
    d = quant.fp4_dequant(packed, s)
    mags = np.abs(d / np.repeat(s, 32, 1))
    assert np.isin(mags, E2M1).all()                                       # every value on the e2m1 grid
    want = np.clip(w / np.repeat(s, 32, 1), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(d, want * np.repeat(s, 32, 1))


def test_fp4_packing_low_nibble_is_even_index():
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 6.0, -0.5          # amax 6 -> scale 2^(2-2) = 1
    packed, s = quant.fp4_quant(w)
    assert s[0, 0] == 1.0
    assert packed[0, 0] & 0xF == 0b0111   # +6: sign 0, exp 11, mantissa 1
    assert packed[0, 0] >> 4 == 0b1001    # -0.5: sign 1, subnormal 001
    w[0, 2] = 100.0                       # saturates: scale 2^(6-2) = 16, 100/16 -> 6
    packed, s = quant.fp4_quant(w)
    assert quant.fp4_dequant(packed, s)[0, 2] == 96.0


# round_once: float64 -> a format in one rounding, against exact rational arithmetic

def nearest_even_oracle(x, fmt):  # exact: Fractions over every finite code of the format
    from fractions import Fraction
    codes = np.arange(1 << (8 * np.dtype(fmt).itemsize), dtype=np.uint16 if np.dtype(fmt).itemsize == 2 else np.uint8)
    with np.errstate(invalid="ignore"):
        vals = codes.view(fmt).astype(np.float64)
    keep = np.isfinite(vals)
    codes, vals = codes[keep], vals[keep]
    order = np.argsort(vals, kind="stable")
    vals, codes = vals[order], codes[order]
    i = int(np.searchsorted(vals, x))
    best = None
    for j in range(max(i - 2, 0), min(i + 2, len(vals))):          # both zeros sit side by side
        d = abs(Fraction(float(vals[j])) - Fraction(float(x)))
        key = (d, np.signbit(vals[j]) != np.signbit(x), int(codes[j]) & 1)  # zero keeps x's sign; tie: even code
        if best is None or key < best[0]:
            best = (key, codes[j])
    return best[1]


@given(st.data(), st.sampled_from(["bf16", "e4m3"]))
def test_round_once_is_one_rounding(data, name):
    fmt, top, bits = (quant.BF16, 3.3e38, np.uint16) if name == "bf16" else (quant.E4M3, 464.0, np.uint8)
    x = data.draw(st.floats(-top, top, allow_nan=False, allow_subnormal=True))  # e4m3fn: below its rounding edge
    got = quant.round_once(np.array([x]), fmt).view(bits)[0]
    assert got == nearest_even_oracle(x, fmt), (x, hex(got))


def test_round_once_differs_from_double_rounding():
    # 1 + 2^-8 + 2^-30: float32 rounds it to the bf16 tie 1 + 2^-8, which then goes to 1.0 (even);
    # one rounding of the exact value goes up to 1 + 2^-7
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -30])
    assert float(x.astype(np.float32).astype(quant.BF16)[0]) == 1.0
    assert float(quant.round_once(x, quant.BF16)[0]) == 1 + 2.0 ** -7


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), st.integers(-20, 10), st.integers(0, 14), st.integers(0, 2 ** 31))
def test_fp4_to_fp8_blocks_is_exact(nb, kb, e_lo, spread, seed):
    # every FP4 value times its 1x32 scale, re-encoded in 128x128 e4m3 blocks, decodes (ml_dtypes, float64)
    # to the same number while a block's scales span at most 14 binades; one more binade is refused
    rng = np.random.default_rng(seed)
    N, K = 128 * nb, 128 * kb
    packed = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    s = np.exp2(rng.integers(e_lo, e_lo + spread + 1, (N, K // 32))).astype(np.float32)
    s[0, 0], s[-1, -1] = 2.0 ** e_lo, 2.0 ** (e_lo + spread)                     # the span reached in some block
    want = quant.fp4_dequant(packed, s).astype(np.float64)
    codes, S = quant.fp4_to_fp8_blocks(packed, s)
    assert codes.dtype == quant.E4M3 and S.shape == (nb, kb)
    got = codes.astype(np.float64) * np.repeat(np.repeat(S.astype(np.float64), 128, 0), 128, 1)
    np.testing.assert_array_equal(got, want)
    s[0, 1] = 2.0 ** (e_lo + 15)                                                 # block (0, 0) now spans 15
    s[0, 0] = 2.0 ** e_lo
    with pytest.raises(ValueError, match=r"block \(0, 0\) span 15 binades"):
        quant.fp4_to_fp8_blocks(packed, s)
