"""attention.py: MHA mode against float64 attention, MHA and absorbed modes agree, RMSNorm against
float64, and (on a whole tiny model) sparse attention with index_topk >= context equals dense."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import attention
import checkpoint
import quant
from helpers import rel_err
from model import Transformer


def attention_oracle(q, k, v, allowed, scale):  # float64, one head and query at a time
    B, T, H, _ = q.shape
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for t in range(T):
            keys = np.nonzero(allowed[b, t])[0]
            for h in range(H):
                z = np.array([q[b, t, h].astype(np.float64) @ k[b, s, h] for s in keys]) * scale
                p = np.exp(z - z.max())
                o[b, t, h] = (p / p.sum()) @ v[b, keys, h].astype(np.float64)
    return o


def random_case(rng, B, T, S, H, N, R, V, C):
    q_nope = rng.standard_normal((B, T, H, N)).astype(np.float32)
    q_pe = rng.standard_normal((B, T, H, R)).astype(np.float32)
    kv = rng.standard_normal((B, S, C)).astype(np.float32)
    pe = rng.standard_normal((B, S, R)).astype(np.float32)
    Wb = (rng.standard_normal((H, N + V, C)) / np.sqrt(C)).astype(np.float32)
    allowed = rng.random((B, T, S)) < 0.6
    allowed &= np.arange(S)[None, None] <= (S - T + np.arange(T))[None, :, None]   # causal
    allowed[:, np.arange(T), S - T + np.arange(T)] = True                           # at least the token itself
    return q_nope, q_pe, kv, pe, Wb, allowed


@given(st.integers(1, 2), st.integers(1, 4), st.integers(0, 6), st.integers(1, 3), st.sampled_from([8, 16]),
       st.sampled_from([4, 8]), st.sampled_from([8, 12]), st.sampled_from([16, 32]), st.integers(0, 2 ** 31))
def test_mha_and_absorbed_agree_with_float64(B, T, past, H, N, R, V, C, seed):
    rng = np.random.default_rng(seed)
    S = past + T
    q_nope, q_pe, kv, pe, Wb, allowed = random_case(rng, B, T, S, H, N, R, V, C)
    scale = (N + R) ** -0.5
    # MHA mode: expand the latent per head
    k_nope = np.einsum("bsc,hnc->bshn", kv, Wb[:, :N])
    v = np.einsum("bsc,hvc->bshv", kv, Wb[:, N:])
    k = np.concatenate([k_nope, np.broadcast_to(pe[:, :, None], (B, S, H, R))], -1)
    q = np.concatenate([q_nope, q_pe], -1)
    mha = attention.mha_ref(q_nope, q_pe, k_nope, pe, v, allowed, scale, quant.no_round)
    absorbed = attention.mqa_absorbed_ref(q_nope, q_pe, kv, pe, Wb[:, :N], Wb[:, N:], allowed, scale, quant.no_round)
    ref = attention_oracle(q, k, v, allowed, scale)
    assert rel_err(mha, ref) <= 1e-5
    assert rel_err(absorbed, ref) <= 1e-5


@given(st.integers(1, 4), st.sampled_from([128, 256, 7]), st.integers(-30, 30), st.integers(0, 2 ** 31))
def test_rms_norm_matches_float64(M, D, e, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, D)) * 2.0 ** e).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = w * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(attention.rms_norm_ref(x, w, 1e-6, quant.no_round), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    got = attention.rms_norm_ref(x, w, 1e-6, quant.bf16_round)
    assert np.all(np.abs(got - ref) <= np.abs(ref) * (2.0 ** -8 + 4e-6))   # half a bf16 step (8 bits) + fp32 noise


@pytest.fixture(scope="module")
def wide_topk_ckpt(tmp_path_factory):
    cfg = checkpoint.tiny_config(index_topk=64)
    path = tmp_path_factory.mktemp("wide") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, 5))


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["exact", "official"])
def test_sparse_with_topk_at_least_context_equals_dense(wide_topk_ckpt, numerics):
    tokens = np.random.default_rng(3).integers(0, 2048, (2, 40))                # 40 <= index_topk = 64
    sparse = Transformer.from_pretrained(wide_topk_ckpt, numerics=numerics).forward(tokens, all_positions=True)
    dense = Transformer.from_pretrained(wide_topk_ckpt, numerics=numerics, attention="dense").forward(tokens, all_positions=True)
    np.testing.assert_array_equal(sparse, dense)
    # and with a context beyond index_topk the selection really changes the result
    long = np.random.default_rng(4).integers(0, 2048, (1, 90))
    s = Transformer.from_pretrained(wide_topk_ckpt, numerics=numerics).forward(long)
    d = Transformer.from_pretrained(wide_topk_ckpt, numerics=numerics, attention="dense").forward(long)
    assert rel_err(s, d) > 1e-3
