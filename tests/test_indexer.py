"""indexer.py: the Hadamard rotation, eq. (1) against float64, eq. (2) against a float64 top-k,
and the training objectives eqs. (3)-(4) against float64 loops."""
import numpy as np
from hypothesis import given, strategies as st

import indexer
import quant


@given(st.sampled_from([1, 2, 4, 16, 128, 256]), st.integers(0, 2 ** 31))
def test_hadamard_is_orthogonal(n, seed):
    H = indexer.hadamard_matrix(n).astype(np.float64)
    np.testing.assert_array_equal(H @ H.T, n * np.eye(n))
    assert np.all(np.abs(H) == 1) and np.all(H == H.T)
    x, y = np.random.default_rng(seed).standard_normal((2, 3, n)).astype(np.float32)
    rx, ry = indexer.rotate_activation_ref(x), indexer.rotate_activation_ref(y)
    np.testing.assert_allclose((rx * ry).sum(-1), (x.astype(np.float64) * y).sum(-1), rtol=1e-5, atol=1e-5)


def scores_oracle(q, w, k, ks):  # float64 loops over heads, straight from eq. (1)
    q, k, w = q.astype(np.float64), k.astype(np.float64), w.astype(np.float64)
    B, T, J, _ = q.shape
    I = np.zeros((B, T, k.shape[1]))
    for j in range(J):
        I += w[:, :, j, None] * np.maximum(np.einsum("btd,bsd->bts", q[:, :, j], k), 0)
    return I * ks[:, None, :]


@given(st.integers(1, 2), st.integers(1, 5), st.integers(1, 17), st.integers(1, 20), st.sampled_from([32, 128]),
       st.booleans(), st.integers(0, 2 ** 31))
def test_index_scores_match_float64(B, T, J, S, D, fp8, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, J, D)).astype(np.float32)
    k = rng.standard_normal((B, S, D)).astype(np.float32)
    w = rng.standard_normal((B, T, J)).astype(np.float32)          # signed head weights
    ks = np.ones((B, S), np.float32)
    if fp8:
        q = q.astype(quant.E4M3)
        k = k.astype(quant.E4M3)
        ks = np.exp2(rng.integers(-4, 4, (B, S))).astype(np.float32)
    got = indexer.index_scores_ref(q, w, k, ks)
    ref = scores_oracle(q, w, k, ks)
    assert got.dtype == np.float32 and got.shape == (B, T, S)
    scale = (np.abs(w).sum(-1, keepdims=True) * np.abs(ks)[:, None]).max() * D
    assert np.abs(got - ref).max() <= 1e-6 * scale


def test_relu_is_per_head_before_the_signed_weights():
    q = np.array([[[[1.0], [1.0]]]], np.float32)     # two heads, D = 1
    k = np.array([[[-1.0]]], np.float32)             # q . k = -1 for both
    w = np.array([[[1.0, -1.0]]], np.float32)
    # folding w into q before the ReLU would give relu(-1) + relu(+1) = 1; per head it is 0
    assert indexer.index_scores_ref(q, w, k, np.ones((1, 1), np.float32))[0, 0, 0] == 0


@given(st.integers(1, 6), st.integers(0, 8), st.integers(1, 12), st.integers(0, 2 ** 31), st.booleans())
def test_topk_is_causal_and_matches_float64(T, start, K, seed, ties):
    rng = np.random.default_rng(seed)
    S = start + T
    I64 = rng.standard_normal((1, T, S))
    if ties:
        I64 = np.round(I64)                           # many exact ties
    I = I64.astype(np.float32)
    sel = indexer.topk_select_ref(I, K, start)[0]
    for t in range(T):
        causal = np.arange(S) <= start + t
        assert not sel[t, ~causal].any()              # never a future key
        assert sel[t].sum() == min(K, causal.sum())
        vals = np.sort(I64[0, t, causal])[::-1]
        kth = vals[min(K, causal.sum()) - 1]
        tol = 2 ** -23 * abs(kth) + 1e-30
        must = causal & (I64[0, t] > kth + tol)       # clearly above the k-th score
        never = causal & (I64[0, t] < kth - tol)      # clearly below it
        assert sel[t, must].all() and not sel[t, never].any()


def test_topk_ties_break_toward_lower_index():
    sel = indexer.topk_select_ref(np.zeros((1, 1, 6), np.float32), 3, 5)[0, 0]
    np.testing.assert_array_equal(sel, [1, 1, 1, 0, 0, 0])


def kl_oracle(A, I, K=None):  # float64 loops over queries, spec §8
    T, H, S = A.shape
    total = 0.0
    for t in range(T):
        keys = list(range(S - T + t + 1))
        if K is not None:
            keys = sorted(keys, key=lambda s: (-np.float32(I[t, s]), s))[:K]
        p = np.array([A[t, :, s].sum() for s in keys])
        p = p / p.sum()
        z = np.array([I[t, s] for s in keys], np.float64)
        logq = z - z.max() - np.log(np.exp(z - z.max()).sum())
        total += sum(pi * (np.log(pi) - lq) for pi, lq in zip(p, logq) if pi > 0)
    return total


def causal_softmax(z, T, S):
    causal = np.arange(S)[None, :] <= (S - T + np.arange(T))[:, None]
    e = np.where(causal, np.exp(z - np.where(causal, z, -np.inf).max(-1, keepdims=True)), 0)
    return e / e.sum(-1, keepdims=True)


@given(st.integers(1, 5), st.integers(0, 4), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2 ** 31))
def test_kl_objectives(T, past, H, K, seed):
    rng = np.random.default_rng(seed)
    S = past + T
    I = rng.standard_normal((T, S)).astype(np.float32)
    A = np.stack([causal_softmax(rng.standard_normal((T, S)), T, S) for _ in range(H)], 1)   # [T, H, S]
    d, s = indexer.indexer_kl_dense(A, I), indexer.indexer_kl_sparse(A, I, K)
    assert np.isclose(d, kl_oracle(A, I), rtol=1e-9, atol=1e-12)
    assert np.isclose(s, kl_oracle(A, I, K), rtol=1e-9, atol=1e-12)
    assert d >= 0 and s >= -1e-12
    # zero when the attention equals the index distribution (every head alike)
    P = causal_softmax(I.astype(np.float64), T, S)
    A_match = np.repeat(P[:, None], H, 1)
    assert abs(indexer.indexer_kl_dense(A_match, I)) < 1e-12
    assert abs(indexer.indexer_kl_sparse(A_match, I, K)) < 1e-12
    # and strictly positive when they differ
    if S > 1:
        assert indexer.indexer_kl_dense(A_match, np.zeros_like(I) + np.arange(S, dtype=np.float32) * 3) > 0


@given(st.integers(1, 2), st.integers(1, 4), st.integers(0, 5), st.sampled_from([4, 16]), st.integers(0, 2 ** 31))
def test_index_prep_ref_is_indexer_forwards_official_steps(B, T, start_pos, J, seed):
    # the kernel's contract (index_prep_ref) and the model's wiring (indexer_forward with the NumPy op
    # table, official numerics, FP8 indexer) write the same key codes and scales and select the same keys
    from types import SimpleNamespace
    import rope
    from ops import NUMPY_OPS
    rng = np.random.default_rng(seed)
    D, R, d, K = 128, 64, 256, 3
    bf = quant.bf16_round
    x = bf(rng.standard_normal((B, T, d)))
    q, k = bf(rng.standard_normal((B, T, J * D))), bf(rng.standard_normal((B, T, D)))
    p = {"k_norm": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
         "k_norm_bias": (0.1 * rng.standard_normal(D)).astype(np.float32),
         "weights_proj": quant.Weight(bf(rng.standard_normal((J, d)) / 16), None)}
    cos, sin = rope.rope_angles(rope.yarn_freqs(R, 10000.0, 64, 64, 1.0, 32, 1), np.arange(start_pos, start_pos + T))
    S = start_pos + T
    earlier = rng.standard_normal((B, S, D)).astype(quant.E4M3)         # keys already cached before start_pos
    caches = [SimpleNamespace(k=earlier.copy(), k_scale=np.ones((B, S), np.float32)) for _ in "ab"]
    args = SimpleNamespace(index_n_heads=J, index_head_dim=D, qk_rope_head_dim=R, index_topk=K)
    opts = SimpleNamespace(official=True, indexer_fp8=True, ops=NUMPY_OPS)
    sel = indexer.indexer_forward(x, q, k, p, caches[0], start_pos, S, cos, sin, args, opts)
    xw = x @ p["weights_proj"].dequant().T
    q8, w = indexer.index_prep_ref(q.reshape(B, T, J, D), k, xw, cos, sin, p["k_norm"], p["k_norm_bias"],
                                   caches[1].k, caches[1].k_scale, start_pos)
    np.testing.assert_array_equal(caches[1].k.view(np.uint8), caches[0].k.view(np.uint8))
    np.testing.assert_array_equal(caches[1].k_scale, caches[0].k_scale)
    np.testing.assert_array_equal(indexer.select_ref(q8, w, caches[1].k, caches[1].k_scale, K, start_pos), sel)
