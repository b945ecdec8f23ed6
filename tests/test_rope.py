"""rope.py: YaRN frequencies against float64 math and the spec's figures; the two layouts agree up to
a fixed permutation and preserve norms; the trace's freqs_cis and roped tensors."""
import math

import numpy as np
from hypothesis import given, strategies as st

import rope
from helpers import assert_bf16_close
import quant


def test_yarn_frequencies_of_the_real_config():
    # spec/dsv32.md §3.3: dim 64, base 1e4, L0 4096, factor 40, beta 32/1, max_seq_len 16384
    f = rope.yarn_freqs(64, 10000.0, 16384, 4096, 40.0, 32, 1)
    np.testing.assert_allclose(f[:4], [1, 0.749894, 0.562341, 0.421696], atol=1e-6)  # spec rounds to 6 places
    np.testing.assert_allclose(f[24], 2.5e-5, rtol=1e-6)
    np.testing.assert_allclose(f[31], 3.3338e-6, rtol=1e-4)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)                          # float64 oracle of the blend
    ramp = np.clip((np.arange(32) - 10) / (23 - 10), 0, 1)                 # low 10, high 23 (spec)
    np.testing.assert_allclose(f, base / 40 * ramp + base * (1 - ramp), rtol=1e-6)
    # inactive at or below the original length: plain RoPE
    np.testing.assert_allclose(rope.yarn_freqs(64, 10000.0, 4096, 4096, 40.0, 32, 1), base, rtol=1e-6)


def test_softmax_scale_of_the_real_config():
    from config import ModelArgs
    a = ModelArgs(max_seq_len=16384, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0,
                                                   "original_max_position_embeddings": 4096})
    assert math.isclose(a.softmax_scale, 0.1352337789, rel_tol=1e-9)
    assert math.isclose(ModelArgs(max_seq_len=4096, rope_scaling=a.rope_scaling).softmax_scale, 192 ** -0.5)


@given(st.integers(1, 6), st.integers(1, 3), st.sampled_from([2, 8, 64]), st.integers(0, 2 ** 31),
       st.integers(0, 100000))
def test_layouts_agree_up_to_permutation_and_keep_norms(T, H, R, seed, p0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, T, H, R)).astype(np.float32)
    freqs = rope.yarn_freqs(R, 10000.0, 1024, 128, 40.0, 32, 1)
    cos, sin = rope.rope_angles(freqs, np.arange(p0, p0 + T))
    perm = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)])        # interleaved -> half-split
    a = rope.rope_interleaved(x, cos, sin)
    b = rope.rope_half_split(x[..., perm], cos, sin)
    np.testing.assert_allclose(a[..., perm], b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(a, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # float64 oracle of the complex rotation
    ang = np.outer(np.arange(p0, p0 + T).astype(np.float32), freqs).astype(np.float64)
    z = (x[..., 0::2] + 1j * x[..., 1::2]).astype(np.complex128) * np.exp(1j * ang)[None, :, None, :]
    np.testing.assert_allclose(a[..., 0::2], z.real, atol=1e-5)
    np.testing.assert_allclose(a[..., 1::2], z.imag, atol=1e-5)


@given(st.integers(0, 2 ** 31))
def test_relative_position_property(seed):
    # q_t . k_s after RoPE depends on t - s only
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, 1, 1, 64))
    freqs = rope.yarn_freqs(64, 10000.0, 1024, 128, 40.0, 32, 1)
    def dot(t, s):
        ct, st_ = rope.rope_angles(freqs, [t])
        cs, ss = rope.rope_angles(freqs, [s])
        return float((rope.rope_half_split(q, ct, st_) * rope.rope_half_split(k, cs, ss)).sum())
    assert math.isclose(dot(7, 3), dot(104, 100), rel_tol=1e-4, abs_tol=1e-4)


def test_trace_rope(trace):
    from config import ModelArgs
    import json
    from conftest import FIXTURE_CKPT
    a = ModelArgs.from_config(json.loads((FIXTURE_CKPT / "config.json").read_text()))
    freqs = rope.yarn_freqs(a.qk_rope_head_dim, a.rope_theta, a.max_seq_len, a.original_seq_len, a.rope_factor, 32, 1)
    cos, sin = rope.rope_angles(freqs, np.arange(53))
    for l in ("l0", "l1"):
        np.testing.assert_allclose(cos, trace[f"{l}.freqs_cis"][..., 0], atol=2e-7)
        np.testing.assert_allclose(sin, trace[f"{l}.freqs_cis"][..., 1], atol=2e-7)
        assert_bf16_close(quant.bf16_round(rope.rope_interleaved(trace[f"{l}.q_pe_in"], cos, sin)),
                          trace[f"{l}.q_pe_roped"], what="MLA q rope")
        assert_bf16_close(quant.bf16_round(rope.rope_interleaved(trace[f"{l}.k_pe_in"], cos, sin)),
                          trace[f"{l}.k_pe_roped"], what="MLA k rope")
        assert_bf16_close(quant.bf16_round(rope.rope_half_split(trace[f"{l}.idx_q_pe_in"], cos, sin)),
                          trace[f"{l}.idx_q_pe_roped"], what="indexer q rope")
        assert_bf16_close(quant.bf16_round(rope.rope_half_split(trace[f"{l}.idx_k_pe_in"], cos, sin)),
                          trace[f"{l}.idx_k_pe_roped"], what="indexer k rope")
