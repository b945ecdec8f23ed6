"""attention_v4.py's sparse attention in official numerics (blocked_attention_ref: the official kernel's
blocks of 64 columns, running max, bf16 probabilities) against float64, and the properties of its blocks:
the order inside a block is free, the order across blocks is not. test_official_trace_v4.py holds it to
the official code's own outputs bit for bit."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attention_v4
import quant
from attention_v4 import BLOCK, blocked_attention_ref, sparse_attention_ref, window_indices_ref


def draw(rng, B, T, H, c, S, K, spread=1.0):  # bf16 q [B, T, H, c], keys [B, S, c], idx [B, T, K] (-1 anywhere), sink [H]
    q = quant.bf16_round(rng.standard_normal((B, T, H, c)) * spread)
    keys = quant.bf16_round(rng.standard_normal((B, S, c)))
    idx = np.stack([np.stack([rng.permutation(S)[:K] for _ in range(T)]) for _ in range(B)])
    idx = np.where(rng.random(idx.shape) < 0.2, -1, idx)
    idx[..., 0] = rng.integers(0, S, (B, T))                                      # every query has a key
    sink = rng.standard_normal(H).astype(np.float32)
    return q, keys, idx, sink


def f64_attention(q, keys, idx, sink, scale):  # the true attention in float64: softmax over the listed keys and the sink
    kb = keys[np.arange(len(keys))[:, None, None], np.maximum(idx, 0)].astype(np.float64)   # [B, T, K, c]
    z = np.einsum("bthc,btkc->bthk", q.astype(np.float64), kb) * scale
    z = np.where(idx[:, :, None] >= 0, z, -np.inf)
    m = np.maximum(z.max(-1, keepdims=True), sink[:, None])
    e = np.exp(z - m)
    p = e / (e.sum(-1, keepdims=True) + np.exp(sink[:, None] - m))
    return np.einsum("bthk,btkc->bthc", p, kb), np.einsum("bthk,btkc->bthc", p, np.abs(kb))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 2), st.integers(1, 4), st.integers(1, 5), st.sampled_from([16, 64]), st.integers(1, 200),
       st.integers(0, 2 ** 31))
def test_blocked_attention_against_float64(B, T, H, c, K, seed):
    # bf16 probabilities (a relative 2^-9 each) and a bf16 output (2^-9): within 2^-7 of Σ p |κ|
    rng = np.random.default_rng(seed)
    q, keys, idx, sink = draw(rng, B, T, H, c, K + 7, K)
    got = blocked_attention_ref(q, keys, idx, sink, c ** -0.5)
    want, mag = f64_attention(q, keys, idx, sink, c ** -0.5)
    assert np.array_equal(got, quant.bf16_round(got))
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * mag + 1e-30)


def test_one_block_rounds_against_the_row_max():
    # up to 64 columns the running max is the row's max: the output is, in float64 written out here,
    # bf16(fp32(Σ bf16(e) κ) / (fp32(Σ e) + exp(sink - m))) with e = fp32(exp(fp32(q . κ) s - m))
    rng = np.random.default_rng(1)
    q, keys, idx, sink = draw(rng, 2, 3, 4, 64, 90, BLOCK, spread=3.0)
    s = np.float32(64 ** -0.5)
    kb = keys[np.arange(2)[:, None, None], np.maximum(idx, 0)]
    z = np.einsum("bthc,btkc->bthk", q.astype(np.float64), kb.astype(np.float64)).astype(np.float32) * s
    z = np.where(idx[:, :, None] >= 0, z, -np.inf)
    m = z.max(-1, keepdims=True)
    e = np.exp((z - m).astype(np.float64)).astype(np.float32)
    acc = np.einsum("bthk,btkc->bthc", quant.bf16_round(e).astype(np.float64), kb.astype(np.float64)).astype(np.float32)
    l = e.sum(-1, keepdims=True, dtype=np.float64).astype(np.float32) + np.exp((sink[:, None] - m).astype(np.float64)).astype(np.float32)
    want = quant.bf16_round(acc / l)
    assert np.array_equal(blocked_attention_ref(q, keys, idx, sink, 64 ** -0.5), want)


@settings(max_examples=10, deadline=None)
@given(st.integers(65, 260), st.integers(0, 2 ** 31))
def test_order_within_a_block_is_free_across_blocks_it_is_not(K, seed):
    rng = np.random.default_rng(seed)
    q, keys, idx, sink = draw(rng, 1, 3, 4, 64, K + 5, K, spread=4.0)
    want = blocked_attention_ref(q, keys, idx, sink, 0.125)
    shuffled = idx.copy()
    for j in range(0, K, BLOCK):                                                   # each block's columns permuted
        shuffled[..., j:j + BLOCK] = shuffled[..., j:j + BLOCK][..., rng.permutation(min(BLOCK, K - j))]
    assert np.array_equal(blocked_attention_ref(q, keys, shuffled, sink, 0.125), want)


def test_the_max_in_a_later_block_rounds_the_earlier_ones_against_their_own():
    # query 0's largest score sits in column 70 (block 1): block 0's probabilities are rounded to bf16
    # against block 0's max and rescaled, not against the row's max; moving that key into block 0
    # gives the global rounding, and a different output
    rng = np.random.default_rng(4)
    q, keys, idx, sink = draw(rng, 1, 1, 8, 64, 140, 128, spread=1.0)
    idx[0, 0] = rng.permutation(140)[:128]
    keys[0, idx[0, 0, 70]] = quant.bf16_round(q[0, 0, 0] * 0.5)                   # head 0's max, by far
    early = idx.copy()
    early[0, 0, [3, 70]] = idx[0, 0, [70, 3]]
    late, first = blocked_attention_ref(q, keys, idx, sink, 0.125), blocked_attention_ref(q, keys, early, sink, 0.125)
    assert not np.array_equal(late[0, 0, 0], first[0, 0, 0])
    assert np.abs(late - first).max() <= 2.0 ** -6 * np.abs(first).max()                 # a rounding apart


def test_sparse_attention_lists_the_dense_keys_after_the_list():
    # HCA's dense keys are columns K, K + 1, ... of the official list, ascending, -1 past n_dense[t]
    rng = np.random.default_rng(2)
    q, KW, _, sink = draw(rng, 1, 4, 2, 16, 70, 70)
    KC = quant.bf16_round(rng.standard_normal((1, 9, 16)))
    idx = window_indices_ref(4, 66, 66, 128)[None]                                # [1, 4, 128]: 67 .. 70 keys
    n_dense = np.array([3, 9, 0, 5])
    dense = np.where(np.arange(9)[None] < n_dense[:, None], 70 + np.arange(9), -1)[None]
    want = blocked_attention_ref(q, np.concatenate([KW, KC], 1), np.concatenate([idx, dense], -1), sink, 0.25)
    assert np.array_equal(sparse_attention_ref(q, KW, KC, idx, n_dense, sink, 0.25, official=True), want)
    exact = sparse_attention_ref(q, KW, KC, idx, n_dense, sink, 0.25, official=False)
    assert np.abs(exact - want).max() <= 2.0 ** -6 * np.abs(exact).max()


def test_the_torch_twins_list_the_keys_as_the_reference():
    # backend_torch's window lists (a chunk's rows, the CUDA-graph step's ring slots) and its reordering of
    # the top-k kernel's ascending picks give the reference's lists: their order decides the official bits
    torch = pytest.importorskip("torch")
    import backend_torch as bt
    from indexer import topk_order_ref
    for W in (4, 16, 128):
        for start in sorted({0, 1, W - 2, W - 1, W, W + 1, 3 * W + 5}):
            for T in (1, 3, W + 7):
                P = min(start, W - 1)
                got = bt.window_indices(T, start, P, W, "cpu").numpy()
                assert np.array_equal(got, window_indices_ref(T, start, P, W)), (W, start, T)
            if start == 0:
                continue                                                           # a decode step follows a prefill
            P = min(start, W - 1)
            want = window_indices_ref(1, start, P, W)                              # rows of [ring | the token]
            slots = np.where(want >= 0, (start - P + want) % W, -1)                # as ring slots
            assert np.array_equal(bt.ring_slots(torch.tensor([start]), W).numpy(), slots), (W, start)
    rng = np.random.default_rng(0)
    for _ in range(50):
        B, T, S, k, start = 2, 3, int(rng.integers(0, 30)), int(rng.integers(1, 9)), int(rng.integers(0, 120))
        I = rng.integers(-3, 3, (B, T, S)).astype(np.float32)                       # many ties
        want = topk_order_ref(I, k, start, 4)
        ascending = np.sort(np.where(want >= 0, want, S + 1), -1)                   # the kernel's contract: ascending,
        ascending = np.where(ascending <= S, ascending, -1)                         # then -1
        got = bt.best_first(torch.from_numpy(I), torch.from_numpy(ascending)).numpy()
        assert np.array_equal(got, want)
