"""kernels_v4.py against mhc.py's references, with hypothesis-drawn shapes, streams, value scales and
Sinkhorn lengths: on a GPU for real, on the CPU under TRITON_INTERPRET=1 (conftest.py). The references
sum Φ x̄ in float64 and the kernels in float32, so the mixes agree to a few float32 ulps (the GPU's exp
is approximate too); a bf16 output may sit on the other side of a rounding boundary: one bf16 ulp."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_v4  # noqa: E402
import mhc  # noqa: E402
import quant  # noqa: E402
from conftest import HAS_CUDA  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"


def bf16_ulp(x):  # the spacing of bf16 values at |x| (8 significant bits), float64
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)


def draw(rng, M, n, d, spread):  # bf16 streams, a mix matrix of V4's scale, base and α as trained ones
    X = quant.bf16_round((rng.standard_normal((M, n, d)) * spread).astype(np.float32))
    fn = (rng.standard_normal(((2 + n) * n, n * d)) / np.sqrt(n * d)).astype(np.float32)
    base = (rng.standard_normal((2 + n) * n) * 0.5).astype(np.float32)
    scale = (rng.random(3) * 2).astype(np.float32)
    return X, fn, base, scale


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.sampled_from([2, 4]), st.integers(1, 300), st.floats(0.01, 100), st.integers(1, 20),
       st.booleans(), st.integers(0, 2 ** 31))
def test_hc_mix_pre_kernel(M, n, d, spread, iters, official, seed):
    rng = np.random.default_rng(seed)
    X, fn, base, scale = draw(rng, M, n, d, spread)
    args = SimpleNamespace(rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=iters)
    pre, post, comb = mhc.hc_mixes_ref(X, fn, base, scale, args, official)
    u = mhc.hc_pre_ref(X, pre, quant.bf16_round if official else quant.no_round)
    got = [g.cpu().numpy() for g in kernels_v4.hc_mix_pre(t(X), t(fn), t(base), scale, args, official)]
    for name, g, w in zip(("pre", "post", "comb"), got, (pre, post, comb)):
        assert g.shape == w.shape and np.abs(g - w).max() <= 2e-5, name      # values in (0, 2]: float32 ulps
    ref_u = np.einsum("mn,mnd->md", pre.astype(np.float64), X.astype(np.float64))
    if official:                                                             # bf16 values: at most one ulp
        assert np.array_equal(got[3], quant.bf16_round(got[3]))
        assert np.all(np.abs(got[3] - u) <= bf16_ulp(ref_u) * 1.0001)
    else:
        assert np.abs(got[3] - u).max() <= 1e-5 * max(1.0, np.abs(u).max())


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 24), st.sampled_from([2, 4, 8]), st.integers(1, 600), st.floats(0.01, 100), st.booleans(),
       st.integers(0, 2 ** 31))
def test_hc_post_kernel(M, n, d, spread, official, seed):
    rng = np.random.default_rng(seed)
    X = quant.bf16_round((rng.standard_normal((M, n, d)) * spread).astype(np.float32))
    y = quant.bf16_round((rng.standard_normal((M, d)) * spread).astype(np.float32))
    post = (2 * rng.random((M, n))).astype(np.float32)
    comb = mhc.sinkhorn_ref(rng.standard_normal((M, n, n)).astype(np.float32), 20, 1e-6).astype(np.float32)
    want = mhc.hc_post_ref(X, y, post, comb, quant.bf16_round if official else quant.no_round)
    got = kernels_v4.hc_post(t(X), t(y), t(post), t(comb), official).cpu().numpy()
    exact = post.astype(np.float64)[:, :, None] * y[:, None, :] + np.einsum("mij,mid->mjd", comb.astype(np.float64), X)
    if official:
        assert np.array_equal(got, quant.bf16_round(got))
        assert np.all(np.abs(got - want) <= bf16_ulp(exact) * 1.0001)
    else:
        assert np.all(np.abs(got - exact) <= 4 * np.finfo(np.float32).eps * (np.abs(exact) + spread))


def test_the_kernels_refuse_shapes_that_do_not_agree():
    args = SimpleNamespace(rms_norm_eps=1e-6, hc_eps=1e-6, hc_sinkhorn_iters=20)
    X = torch.zeros(2, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="hc_mix_pre"):
        kernels_v4.hc_mix_pre(X, torch.zeros(24, 31, device=DEV), torch.zeros(24, device=DEV), [1, 1, 1], args)
    with pytest.raises(ValueError, match="hc_mix_pre"):
        kernels_v4.hc_mix_pre(torch.zeros(2, 3, 8, device=DEV), torch.zeros(15, 24, device=DEV),
                              torch.zeros(15, device=DEV), [1, 1, 1], args)
    with pytest.raises(ValueError, match="hc_post"):
        kernels_v4.hc_post(X, torch.zeros(2, 7, device=DEV), torch.zeros(2, 4, device=DEV), torch.zeros(2, 4, 4, device=DEV))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(1, 150), st.integers(1, 4), st.floats(0.01, 100), st.integers(-12, 4),
       st.booleans(), st.integers(0, 2 ** 31))
def test_fp4_gemm_kernel(M, N, Kb, spread, e_lo, fnuz, seed):
    # quant.fp4_gemm's promotion order (per 32-wide K block: partial x activation scale x weight scale); the
    # kernel's fp32 sums of exact fp16 products may round a partial differently where it needs more than 24
    # bits: bounded by 2^-20 of the magnitudes' sum. fnuz (gfx942): the same bytes read as e4m3fnuz are half
    # the e4m3fn values, so the activation scales double (0x80, NaN there, is -0 here: mapped to +0)
    rng = np.random.default_rng(seed)
    K = 128 * Kb
    q, sa = quant.act_quant((rng.standard_normal((M, K)) * spread).astype(np.float32))
    codes = np.array(q.view(np.uint8))
    codes[codes == 0x80] = 0
    q = codes.view(quant.E4M3)
    packed = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
    sb = np.exp2(rng.integers(e_lo, e_lo + 6, (N, K // 32))).astype(np.float32)
    want = quant.fp4_gemm(q, sa, packed, sb)
    mag = quant.fp4_gemm((codes & 0x7F).view(quant.E4M3), sa, packed & 0x77, sb)          # sum of |terms|, a bound
    got = kernels_v4.fp4_gemm(t(codes), t(sa * (2 if fnuz else 1)), t(packed), t(sb), fnuz=fnuz).cpu().numpy()
    assert np.all(np.abs(got - want) <= 2.0 ** -20 * mag)
