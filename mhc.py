"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4 paper §2.2): the residual stream of V4 is
n = hc_mult parallel streams, collapsed into one input before every sub-layer and expanded back after
it, with a doubly stochastic mix of the streams in between (spec/v4_flash.md §2.2, §2.8).

    x̄       = vec(X_t) in R^{n d}                    the streams of token t, stream-major
    μ       = Φ x̄ / sqrt(mean(x̄²) + eps)              [pre (n) | post (n) | comb (n²)] mixes
    a_i     = σ(α0 μ_i + b_i) + ε                     pre: collapse weights
    c_j     = 2 σ(α1 μ_{n+j} + b_{n+j})               post: expand weights, in (0, 2)
    B       = Sinkhorn(softmax_j(α2 μ_{2n+ni+j} + b_{2n+ni+j}) + ε)   comb: row i = source stream i
    u_t     = Σ_i a_i X_{t,i}                         the sub-layer's input (before its RMSNorm)
    X'_{t,j} = c_j y_t + Σ_i B_ij X_{t,i}             y_t: the sub-layer's output

The output head collapses the streams once more with its own pre weights (no Sinkhorn, no post).
Official numerics: the mixes, Sinkhorn and the sums in fp32, the streams and the collapsed input held
in bf16, and Φ x̄ computed before its scale (transformers normalises x̄ first).

Letters: M tokens, n streams, d hidden size.
"""
import numpy as np

import quant


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def sinkhorn_ref(B0, iters, eps):  # [..., n, n] logits -> [..., n, n], rows and columns summing to ~1
    """Softmax over each row plus eps, then alternate normalisations, columns first: t_max = iters
    column normalisations and iters - 1 row ones (the official kernel's schedule)."""
    B = np.exp(B0 - B0.max(-1, keepdims=True))
    B = B / B.sum(-1, keepdims=True) + np.float32(eps)                         # softmax_j + eps
    B = B / (B.sum(-2, keepdims=True) + np.float32(eps))                        # columns
    for _ in range(iters - 1):
        B = B / (B.sum(-1, keepdims=True) + np.float32(eps))                    # rows
        B = B / (B.sum(-2, keepdims=True) + np.float32(eps))                    # columns
    return B


def mixes(x, fn, eps, official):  # x̄ [M, n d] -> μ = Φ x̄ / sqrt(mean(x̄²) + eps) [M, rows], float32
    r = np.float32(1) / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    if official:                                        # the official code: the GEMM first, then the scale
        return quant.matmul_f32(x, fn.T) * r
    return quant.matmul_f32(x * r, fn.T)                # transformers: RMSNorm₀, then the GEMM


def hc_mixes_ref(X, fn, base, scale, args, official=False):  # X [M, n, d], Φ [(2+n) n, n d] -> pre, post [M, n], comb [M, n, n]
    M, n, d = X.shape
    x = np.asarray(X, np.float32).reshape(M, n * d)                             # x̄, stream-major
    mu = mixes(x, fn, args.rms_norm_eps, official)                              # Φ RMSNorm₀(x̄), in fp32
    pre = sigmoid(scale[0] * mu[:, :n] + base[:n]) + np.float32(args.hc_eps)     # fp32 throughout
    post = 2 * sigmoid(scale[1] * mu[:, n:2 * n] + base[n:2 * n])
    comb = sinkhorn_ref((scale[2] * mu[:, 2 * n:] + base[2 * n:]).reshape(M, n, n), args.hc_sinkhorn_iters,
                        args.hc_eps)
    return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)


def hc_pre_ref(X, pre, rnd=quant.no_round):  # [M, n, d], [M, n] -> u [M, d] = sum_i a_i X_i (fp32, then rnd)
    return rnd(np.einsum("mn,mnd->md", pre, X))


def hc_mix_pre_ref(X, fn, base, scale, args, official=False):  # -> pre, post [M, n], comb [M, n, n], u [M, d]
    """What a sub-layer needs before it runs: the three mixes, then the collapse u (bf16 in official
    numerics); one op, because a GPU computes both in one pass over the streams (kernels_v4.hc_mix_pre)."""
    pre, post, comb = hc_mixes_ref(X, fn, base, scale, args, official)
    return pre, post, comb, hc_pre_ref(X, pre, quant.bf16_round if official else quant.no_round)


def hc_post_ref(X, y, post, comb, official=False):  # [M, n, d], [M, d], [M, n], [M, n, n] -> X' [M, n, d]
    """official: the streams are held in bf16 between sub-layers; the mix is fp32."""
    rnd = quant.bf16_round if official else quant.no_round
    return rnd(post[:, :, None] * y[:, None, :] + np.einsum("mij,mid->mjd", comb, X))        # B^T X


def hc_head_ref(X, fn, base, scale, args, official=False):  # the output head's collapse: [M, n, d] -> [M, d]
    M, n, d = X.shape
    x = np.asarray(X, np.float32).reshape(M, n * d)
    mu = mixes(x, fn, args.rms_norm_eps, official)                               # [M, n]
    pre = sigmoid(scale[0] * mu + base) + np.float32(args.hc_eps)
    return hc_pre_ref(X, pre.astype(np.float32), quant.bf16_round if official else quant.no_round)
