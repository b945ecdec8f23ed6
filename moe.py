"""DeepSeekMoE with auxiliary-loss-free load balancing (DeepSeek-V3 report §2.1.2, eqs. (12)-(16)),
and the dense SwiGLU MLP of the first `first_k_dense_replace` layers.

    s_{i,t} = sigmoid(u_t . e_i)                                  eq. (15) (softmax for older configs)
    choose Top-K by s_{i,t} + b_i  (b_i = e_score_correction_bias: choice only, never the weight)
    g_{i,t} = s_{i,t} / sum_{j in TopK} s_{j,t} * routed_scaling_factor     eq. (13)-(14)
    h'_t = u_t + sum_i FFN^s_i(u_t) + sum_i g_{i,t} FFN^r_i(u_t)           eq. (12)

Group-limited routing (node-limited in the report): experts split into n_group groups; a group
scores the sum of its top-2 biased scores (top-1, the amax, when there is no bias); only the best
topk_group groups compete.

Letters: M tokens (B*T flattened), d model width, E routed experts, G groups, K experts per token.
"""
import numpy as np

import quant


def silu(x):
    return x / (1 + np.exp(-x))


def mlp_ref(x, p, official, limit=None, weight=None):  # [M, d] -> [M, d]: w2( silu(w1 x) * (w3 x) ), SwiGLU
    """limit (V4's swiglu_limit): silu(min(w1 x, limit)) * clip(w3 x, -limit, limit). weight [M] (V4's
    official code): the routing weight multiplied in fp32 before w2, not after it."""
    rnd = quant.bf16_round if official else quant.no_round
    a = quant.linear_ref(x, p["w1"], official)
    b = quant.linear_ref(x, p["w3"], official)
    if limit is not None:                                                 # not in V3: V4's clamped SwiGLU
        a, b = np.minimum(a, np.float32(limit)), np.clip(b, np.float32(-limit), np.float32(limit))
    h = silu(a) * b                                                       # silu * up in fp32
    if weight is not None:
        h = h * weight[:, None]
    return quant.linear_ref(rnd(h), p["w2"], official)                    # then bf16 into w2


def gate_ref(x, weight, bias, args, hashed=None):  # [M, d], [E, d], [E] or None -> weights [M, K] f32, indices [M, K]
    """hashed [M, K] (V4's first layers, tid2eid of each token): the experts are given, the scores
    still weight them."""
    logits = quant.matmul_f32(x, np.asarray(weight, np.float32).T)      # fp32 router (official), any batch alike
    if args.scoring_func == "sqrtsoftplus":                               # V4: sqrt(softplus(u . e))
        s = np.sqrt(np.logaddexp(0, logits.astype(np.float64)).astype(np.float32))   # softplus rounded once, sqrt
    elif args.scoring_func == "sigmoid":
        s = 1 / (1 + np.exp(-logits))                                     # eq. (15)
    elif args.scoring_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        s = e / e.sum(-1, keepdims=True)
    else:
        raise ValueError(f"scoring_func {args.scoring_func!r} is not sqrtsoftplus, sigmoid or softmax")
    choice = s if bias is None else s + bias                              # bias: for choice only
    M, E = s.shape
    G = args.n_group
    if G > 1:
        grouped = choice.reshape(M, G, E // G)
        if bias is None:
            group_score = grouped.max(-1)                                 # top-1 per group
        else:
            group_score = np.sort(grouped, -1)[..., -2:].sum(-1)          # sum of top-2 per group
        keep = np.argsort(-group_score, -1, kind="stable")[:, :args.topk_group]   # [M, topk_group]
        in_kept = np.zeros((M, G), bool)
        np.put_along_axis(in_kept, keep, True, -1)
        choice = np.where(np.repeat(in_kept, E // G, 1), choice, -np.inf)
    idx = np.argsort(-choice, -1, kind="stable")[:, :args.num_experts_per_tok]    # [M, K], best first
    if hashed is not None:                                                # V4 hash routing: the table's choice
        idx = np.asarray(hashed, np.int64)
    w = np.take_along_axis(s, idx, -1)                                    # original scores, no bias
    if args.norm_topk_prob:
        w = w / w.sum(-1, keepdims=True)                                  # eq. (14), no epsilon
    return (w * np.float32(args.routed_scaling_factor)).astype(np.float32), idx


def moe_ref(x, p, args, official, tokens=None, weight_inside=False):  # [M, d] -> [M, d]
    """Routed experts accumulate in fp32 in expert-id order, the shared experts last, one rounding.
    V4: tokens [M] (the input ids) route the layers holding a tid2eid table; args.swiglu_limit clamps;
    weight_inside: the routing weight enters before w2 (V4's official code; the same in exact arithmetic)."""
    hashed = p["tid2eid"][tokens] if "tid2eid" in p else None
    w, idx = gate_ref(x, p["gate"].dequant(), p.get("gate_bias"), args, hashed)
    limit = args.swiglu_limit
    y = np.zeros(x.shape, np.float32)
    for e in np.unique(idx):                                              # only experts some token chose
        tok, slot = np.nonzero(idx == e)
        if weight_inside:
            y[tok] += mlp_ref(x[tok], p["experts"][e], official, limit, w[tok, slot])
        else:
            y[tok] += mlp_ref(x[tok], p["experts"][e], official, limit) * w[tok, slot, None]
    y += mlp_ref(x, p["shared_experts"], official, limit)            # eq. (12), shared experts
    return quant.bf16_round(y) if official else y
