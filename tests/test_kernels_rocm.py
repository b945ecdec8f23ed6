"""kernels_rocm.py's variants for each AMD architecture (gfx942, gfx950, gfx90a) against the references in the
arch's FP8 flavour: act_quant, prepare_weight, the FP8 and grouped GEMMs against quant.fp8_gemm, swiglu_quant,
the DSA kernels (index scores, top-k, sparse MLA, index_prep) against indexer's references and float64
attention. In the Triton CPU interpreter (conftest.py), or on an AMD GPU; skipped on an NVIDIA one."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_rocm
import quant
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from conftest import HAS_CUDA
from helpers import DEV, INTERPRETED, assert_codes, assert_fp8_gemm_close, t8

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
@settings(max_examples=4)
@given(st.integers(1, 24), st.integers(1, 130), st.sampled_from([128, 256]), st.integers(0, 2 ** 31))
def test_rocm_kernels(arch, M, N, K, seed):
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    flavour = quant.E4M3FNUZ if fnuz else quant.E4M3
    q, s = kernels_rocm.act_quant(torch.from_numpy(x).to(DEV), arch=arch)
    qr, sr = quant.act_quant(x, fp8=flavour)                                 # the flavour's own maximum (240 or 448)
    np.testing.assert_array_equal(s.cpu().numpy(), sr)
    if arch != "gfx90a":
        assert_codes(q, qr, f"act_quant {arch}")
    else:                                                                   # gfx90a quantizes in torch: exact
        np.testing.assert_array_equal(q.view(torch.uint8).cpu().numpy(), qr.view(np.uint8))
    b, sb = quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32))
    bw, bs = kernels_rocm.prepare_weight(t8(b), torch.from_numpy(sb).to(DEV), arch=arch)
    b_ref, sb_ref = quant.to_e4m3fnuz(b, sb) if fnuz else (b, sb)
    np.testing.assert_array_equal(bw.view(torch.uint8).cpu().numpy(), b_ref.view(np.uint8))
    np.testing.assert_array_equal(bs.cpu().numpy(), sb_ref)
    a = t8(qr, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    got = kernels_rocm.fp8_gemm(a, torch.from_numpy(sr).to(DEV), bw, bs, out_dtype=torch.float32, arch=arch)
    ref = quant.fp8_gemm(qr, sr, b_ref, sb_ref)
    assert_fp8_gemm_close(got.cpu().numpy(), ref, qr, sr, b_ref, sb_ref)
    # swiglu_quant in the flavour (gfx90a: torch's steps): each value within one e4m3 step of the reference's
    import moe
    g = (rng.standard_normal((M, 2 * K)) * 3).astype(np.float32)
    G = torch.from_numpy(g).to(DEV)
    qh, sh = kernels_rocm.swiglu_quant(G[:, :K], G[:, K:], True, arch=arch)
    qhr, shr = quant.act_quant(quant.bf16_round(moe.silu(g[:, :K]) * g[:, K:]), fp8=flavour)
    got_h = qh.float().cpu().numpy() * sh.cpu().numpy().repeat(128, 1)
    want_h = qhr.astype(np.float32) * shr.repeat(128, 1)
    step = np.maximum(2.0 ** -3 * np.maximum(np.abs(got_h), np.abs(want_h)), 2.0 ** -9 * shr.repeat(128, 1))
    ok = np.abs(got_h - want_h) <= step
    if INTERPRETED:                                                         # the cast's lost carry (assert_codes)
        ok |= (got_h == want_h / 2) & (np.exp2(np.round(np.log2(np.abs(want_h) + 1e-30))) == np.abs(want_h))
    assert ok.all(), f"swiglu_quant {arch}: {list(zip(got_h[~ok], want_h[~ok]))[:4]}"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
def test_rocm_dsa_kernels(arch):
    """The DSA kernels with each AMD architecture's data, against the references: the indexer's FP8 in
    the arch's flavour (fnuz on gfx942; bytes decoded to fp16 on gfx90a), the packed latent's e4m3fn
    codes quantized by latent_quant and read natively or decoded from their bytes."""
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    import indexer
    rng = np.random.default_rng(11)
    B, T, J, D, past, K = 1, 3, 16, 128, 37, 8
    S = past + T
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    assert kernels_rocm.fp8_dtype(arch) == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    flavour = quant.E4M3FNUZ if fnuz else quant.E4M3
    q, k = (rng.standard_normal(sh).astype(flavour) for sh in ((B, T, J, D), (B, S, D)))
    w, ks = rng.standard_normal((B, T, J)).astype(np.float32), np.exp2(rng.integers(-2, 2, (B, S))).astype(np.float32)
    dt = kernels_rocm.fp8_dtype(arch)
    got = kernels_rocm.index_scores(t8(q, dt), torch.from_numpy(w).to(DEV), t8(k, dt), torch.from_numpy(ks).to(DEV),
                                    past, arch=arch).cpu().numpy()
    ref = indexer.index_scores_ref(q, w, k, ks)
    causal = indexer.causal_ref(T, past)[None]
    assert np.abs(np.where(causal, got - ref, 0)).max() <= 1e-6 * np.abs(ref).max()
    idx = kernels_rocm.topk_indices(torch.from_numpy(ref).to(DEV), K, past).cpu().numpy()
    np.testing.assert_array_equal(idx, indexer.selection_indices_ref(indexer.topk_select_ref(ref, K, past), K))
    # sparse MLA over packed rows whose codes come from latent_quant
    H, C, R = 16, 128, 32
    kv = quant.bf16_round(rng.standard_normal((B, S, C)) * 3)
    pe = quant.bf16_round(rng.standard_normal((B, S, R)))
    cq, cs = kernels_rocm.latent_quant(torch.from_numpy(kv.reshape(-1, C)).to(DEV), arch=arch)
    assert cq.dtype == torch.float8_e4m3fn
    rows = torch.cat([cq.view(torch.uint8), cs.float().contiguous().view(torch.uint8),
                      torch.from_numpy(pe.reshape(-1, R)).to(DEV).to(torch.bfloat16).view(torch.uint8)], -1).reshape(B, S, -1)
    codes = cq.view(torch.uint8).cpu().numpy().view(quant.E4M3)            # the rows' values, decoded by ml_dtypes
    kv_vals = quant.act_dequant(codes, cs.float().cpu().numpy()).reshape(B, S, C).astype(np.float64)
    qa = quant.bf16_round(rng.standard_normal((B, T, H, C))).astype(np.float64)
    qp = quant.bf16_round(rng.standard_normal((B, T, H, R))).astype(np.float64)
    tq = [torch.from_numpy(a.astype(np.float32)).to(DEV) for a in (qa, qp)]
    for fn in (kernels_rocm.sparse_mla_decode, kernels_rocm.sparse_mla_prefill):
        o, _ = fn(*tq, rows, torch.from_numpy(idx).to(DEV), 0.1, past, arch=arch, out_dtype=torch.float32)
        o = o.cpu().numpy()
        for t in range(T):
            sel = idx[0, t][idx[0, t] >= 0]
            z = (qa[0, t] @ kv_vals[0, sel].T + qp[0, t] @ pe[0, sel].T) * 0.1
            p = np.exp(z - z.max(1, keepdims=True))
            want = (p / p.sum(1, keepdims=True)) @ kv_vals[0, sel]
            assert np.abs(o[0, t] - want).max() <= 2.0 ** -8 * np.abs(kv_vals).max(), (fn.__name__, t)
    # the indexer's per-token steps in the arch's FP8 flavour and maximum (gfx90a: no FP8 stores, unfused)
    assert kernels_rocm.fp8_stores(arch) == (arch != "gfx90a")
    xq = quant.bf16_round(rng.standard_normal((B, T, J, D)) * 4)
    cos, sin = (np.cos(np.arange(T * 32).reshape(T, 32)).astype(np.float32), np.sin(np.arange(T * 32).reshape(T, 32)).astype(np.float32))
    args = [torch.from_numpy(a).to(DEV) for a in (xq, quant.bf16_round(rng.standard_normal((B, T, D))), np.ones((B, T, J), np.float32),
                                                  cos, sin, np.ones(D, np.float32), np.zeros(D, np.float32))]
    kc, kcs = torch.zeros(B, S, D, dtype=dt, device=DEV), torch.zeros(B, S, device=DEV)
    if arch == "gfx90a":
        with pytest.raises(NotImplementedError):
            kernels_rocm.index_prep(*args, kc, kcs, past, arch=arch)
        return
    q8, _ = kernels_rocm.index_prep(*args, kc, kcs, past, arch=arch)
    assert q8.dtype == dt
    import rope
    qr = np.concatenate([quant.bf16_round(rope.rope_half_split(xq[..., :64], cos, sin)), xq[..., 64:]], -1)
    q8r, _ = quant.act_quant(quant.bf16_round(indexer.rotate_activation_ref(qr)), fp8=flavour)   # max 240 or 448
    assert_codes(q8, q8r, f"index_prep {arch}")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx90a"])
def test_rocm_moe_gemm(arch):
    if HAS_CUDA and not torch.version.hip:
        pytest.skip("ROCm variants run in the interpreter (or on an AMD GPU)")
    import backend_torch
    rng = np.random.default_rng(7)
    M, Kt, E, N, K = 5, 2, 4, 96, 256
    fnuz = kernels_rocm.ARCHS[arch]["fnuz"]
    idx = np.stack([rng.choice(E, Kt, replace=False) for _ in range(M)])
    a, sa = quant.act_quant((rng.standard_normal((M, K)) * 3).astype(np.float32), fp8=quant.E4M3FNUZ if fnuz else quant.E4M3)
    ws = [quant.weight_quant(rng.standard_normal((N, K)).astype(np.float32)) for _ in range(E)]
    prepared = [kernels_rocm.prepare_weight(t8(w), torch.from_numpy(s).to(DEV), arch=arch) for w, s in ws]
    W = torch.stack([w for w, _ in prepared]), torch.stack([s for _, s in prepared])
    rows, pair_at, block_expert = backend_torch.route(torch.from_numpy(idx).to(DEV), E, 16)
    got = kernels_rocm.moe_gemm(t8(a, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn), torch.from_numpy(sa).to(DEV),
                                *W, rows, block_expert, out_dtype=torch.float32, arch=arch).cpu().numpy()
    rows_np, pair_np = rows.cpu().numpy(), pair_at.cpu().numpy()
    for p in np.nonzero(rows_np >= 0)[0]:
        t, slot = divmod(int(pair_np[p]), Kt)
        w, s = ws[idx[t, slot]]
        w, s = quant.to_e4m3fnuz(w, s) if fnuz else (w, s)
        ref = quant.fp8_gemm(a[t:t + 1], sa[t:t + 1], w, s)[0]
        assert_fp8_gemm_close(got[p], ref, a[t:t + 1], sa[t:t + 1], w, s)
