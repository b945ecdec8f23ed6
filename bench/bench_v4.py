"""DeepSeek-V4-Flash's long-context cost on one GPU: one attention sublayer of each kind at the
real dimensions (64 heads of 512, q rank 1024, 8 output groups; the CSA indexer's 64 heads of 128 and
top-512; random weights in the real formats, official numerics), through the torch path and kernels_v4,
at contexts L = 4K .. 1M, beside one DeepSeek-V3.2-Exp DSA attention sublayer from bench_fig3.py's stored
run (the contexts it reached), and the KV-cache bytes each model keeps per token of context.

    decode    the attention sublayer's step at L replayed from a CUDA graph (ops.v4_attention_step, what
              TransformerV4.decode_static runs: the compressors' steps, the CSA indexer and top-k, the
              sparse attention, the projections), batch 1 and BATCH; and its kernels alone (CSA: the
              indexer's scores, top-k, the sparse attention; HCA / SWA: the attention), graph-replayed
    prefill   a 4096-token chunk ending at L (start_pos = L - 4096), time / 4096, eager
    bytes     KV cache per token of context, whole model: V4-Flash (21 CSA, 20 HCA layers; the official
              storage: 448 FP8 + 64 bf16 dims and 7 scales a key, FP4 indexer keys 64 B + 4 scales) and
              V3.2-Exp (61 layers of 656 B packed latent rows + 132 B indexer keys); and what this
              project's torch path holds (float32 keys)

    whole     decode tok/s of the 43-layer model at batch 1, ESTIMATED as the sum of measured parts, each
              graph-replayed: 2 SWA + 21 CSA + 20 HCA attention sublayers, 43 MoE sublayers (256 FP4
              experts stacked, top-6 through the grouped GEMM + the shared one; the same with the experts
              re-encoded to block FP8, the second route, measured beside it), 86 mHC pairs (hc_mix_pre +
              hc_post) and the fp32 head; beside the gfx90a report's 74.5 tok/s (four GPUs, tensor parallel)

The caches hold random values for position L (the costs do not depend on them).

    python bench/bench_v4.py [--out DIR] [--max-l N]     writes DIR/v4.json (and v4.png with matplotlib)
    python bench/bench_v4.py --render FILE.json [--png FILE.png]
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LS = [4096, 16384, 65536, 131072, 262144, 1048576]
CHUNK, BATCH, STEPS = 4096, 32, 8
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
SHORT = {"sliding_attention": "SWA", "compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}
FIG3 = Path(__file__).resolve().parent / "fig3_h200_2026-11-30.json"
CLAIM = {"flops": 0.10, "kv": 0.07}     # V4-Flash at 1M context against V3.2 (the V4 report, model card)


def kv_bytes():  # whole model, bytes of cache per token of context
    import model_v4
    from config import V4Args
    a = V4Args(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])             # V4-Flash's 43 layers (+ MTP's entry)
    official = model_v4.cache_bytes_per_token(a, 448 + 2 * 64 + 7, 64 + 4)
    ours = model_v4.cache_bytes_per_token(a, 4 * 512, 4 * 128)
    v32 = 61 * (656 + 132)
    return dict(v4_official=official, v4_torch_path=ours, v32=v32, v4_over_v32=official / v32)


def flops_per_token(L):  # attention-dependent multiply-adds x 2 at context L, plus 2 x active parameters
    csa = 21 * (2 * 64 * 128 * (L // 4) + 4 * 64 * 512 * (128 + min(512, L // 4)))       # indexer + attention
    hca = 20 * 4 * 64 * 512 * (128 + L // 128)
    swa = 2 * 4 * 64 * 512 * 128
    v4 = csa + hca + swa + 2 * 13e9
    v32 = 61 * (2 * 64 * 128 * L + 4 * 128 * 576 * min(2048, L)) + 2 * 37e9             # indexer + sparse MLA
    return dict(v4=v4, v32=v32, ratio=v4 / v32)


COLUMNS = {"step_b1": "sublayer b1 (graph)", "decode_b1": "decode b1 (eager)", "kernels_b1": "kernels b1 (graph)",
           f"step_b{BATCH}": f"sublayer b{BATCH} (graph)", f"decode_b{BATCH}": f"decode b{BATCH} (eager)",
           "prefill": "prefill"}      # decode_*: runs from before the graph-captured step (eager steps)


def whole_estimate(d, moe="moe_b1"):  # {L: (us, tok/s)}: V4-Flash's 43 layers at batch 1 from the measured parts
    r, p, out = d["us_per_token"], d["parts_us"], {}
    for L in LS:
        a = [r[k]["step_b1"].get(str(L)) for k in KINDS]
        if None not in a:
            us = 2 * a[0] + 21 * a[1] + 20 * a[2] + 43 * (p[moe] + 2 * p["hc_b1"]) + p["head_b1"]
            out[L] = (us, 1e6 / us)
    return out


def render(d):
    m = d["meta"]
    r = d["us_per_token"]
    cols = [w for w in COLUMNS if any(r[k].get(w) for k in KINDS)]
    lines = [f"{m['gpu']}, {m['date']}, torch {m['torch']}, triton {m['triton']}; one attention sublayer of DeepSeek-V4-Flash "
             "at real dimensions, official numerics; microseconds per token", "",
             "| L | " + " | ".join(f"{SHORT[k]} {COLUMNS[w]}" for k in KINDS for w in cols)
             + " | V3.2 DSA sublayer decode b1 (graph) | V3.2 DSA sublayer prefill |",
             "|---|" + "---|" * (len(cols) * len(KINDS) + 2)]
    v32 = d.get("v32_attention", {})
    for L in LS:
        cells = []
        for k in KINDS:
            for what in cols:
                v = r[k][what].get(str(L))
                cells.append(f"{v:.1f}" if v is not None else "-")
        for what in ("attn_decode_b1", "attn_prefill"):
            v = v32.get(what, {}).get(str(L))
            cells.append(f"{v:.1f}" if v is not None else "-")
        lines.append(f"| {L // 1024}K | " + " | ".join(cells) + " |")
    p = d.get("parts_us")
    if p:
        fp8 = (f"; with the experts re-encoded to block FP8 b1 {p['moe_fp8_b1']:.1f}, b{BATCH} {p[f'moe_fp8_b{BATCH}']:.1f}"
               if "moe_fp8_b1" in p else "")
        how = "graph" if "step_b1" in cols else "eager"
        w13 = (f"; of which the first grouped GEMM (gate | up) alone: FP4 b1 {p['w13_fp4_b1']:.1f}, b{BATCH} "
               f"{p[f'w13_fp4_b{BATCH}']:.1f}, FP8 b1 {p['w13_fp8_b1']:.1f}, b{BATCH} {p[f'w13_fp8_b{BATCH}']:.1f}, and the "
               f"routing's bookkeeping b1 {p['route_b1']:.1f}" if "w13_fp4_b1" in p else "")
        lines += ["", f"Other parts, us per decode step: MoE sublayer b1 {p['moe_b1']:.1f} ({how}), b{BATCH} "
                  f"{p[f'moe_b{BATCH}']:.1f} per token{fp8}{w13}; mHC pair (hc_mix_pre + hc_post) b1 {p['hc_b1']:.1f}, b{BATCH} "
                  f"{p[f'hc_b{BATCH}']:.1f} per token (graph); fp32 head b1 {p['head_b1']:.1f} (graph)"]
        if "step_b1" in cols:
            fp8 = whole_estimate(d, "moe_fp8_b1")
            for L, (us, tps) in whole_estimate(d).items():
                lines.append(f"Whole model at {L // 1024}K, batch 1, ESTIMATED from the parts: {us / 1e3:.1f} ms a token, "
                             f"{tps:.1f} tok/s; FP8 experts {fp8[L][1]:.1f} tok/s (the gfx90a report: 74.5 tok/s on four GPUs)")
    b, f = d["kv_bytes_per_token"], d["flops_1m"]
    lines += ["", f"KV cache per token of context, whole model: V4-Flash {b['v4_official']:.0f} B (official storage; this "
              f"project's float32 caches {b['v4_torch_path']:.0f} B), V3.2-Exp {b['v32']:.0f} B: {b['v4_over_v32']:.1%} "
              f"(the V4 report: {CLAIM['kv']:.0%})",
              f"FLOPs per token at 1M, counted: V4-Flash {f['v4'] / 1e9:.0f} G, V3.2-Exp {f['v32'] / 1e9:.0f} G: "
              f"{f['ratio']:.1%} (the V4 report: {CLAIM['flops']:.0%})"]
    return "\n".join(lines)


def plot(d, png):
    from bench_fig3 import context_axis, pyplot
    plt = pyplot()
    if plt is None:
        return False
    r, v32 = d["us_per_token"], d.get("v32_attention", {})
    step = "step_b1" if any(r[k].get("step_b1") for k in KINDS) else "decode_b1"
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (what, v32what, title) in zip(axes, (("kernels_b1", "attn_decode_b1", "decode kernels, batch 1 (graph)"),
                                                 (step, "attn_decode_b1", f"decode sublayer, batch 1 ({'graph' if step == 'step_b1' else 'eager'})"),
                                                 ("prefill", "attn_prefill", "prefill, 4K chunk ending at L"))):
        for k, style in zip(KINDS, ("^-", "o-", "s-")):
            xs = [L for L in LS if str(L) in r[k][what]]
            ax.plot([x / 1024 for x in xs], [r[k][what][str(x)] for x in xs], style, label=f"V4 {SHORT[k]}")
        xs = [L for L in LS if str(L) in v32.get(v32what, {})]
        if xs:
            ax.plot([x / 1024 for x in xs], [v32[v32what][str(x)] for x in xs], "k--", label="V3.2 DSA (bench_fig3)")
        ax.set_yscale("log")
        context_axis(ax, LS, "context L", "us per token, one attention sublayer", title)
    fig.suptitle(f"DeepSeek-V4-Flash attention sublayers against context, one {d['meta']['gpu']} ({d['meta']['date']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for v4.json and v4.png")
    ap.add_argument("--render", help="print the table of a stored v4.json (and --png FILE: plot it)")
    ap.add_argument("--png")
    ap.add_argument("--max-l", type=int, default=LS[-1], help="largest context to measure (default 1M)")
    ap.add_argument("--kinds", default=",".join(SHORT[k] for k in KINDS), help="which layers: SWA,CSA,HCA")
    a = ap.parse_args()
    if a.render:
        d = json.loads(Path(a.render).read_text())
        print(render(d))
        if a.png:
            plot(d, a.png)
        return
    import torch
    import triton
    import backend_torch
    import quant
    from config import V4Args

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    args = V4Args.from_config(dict(vocab_size=1024, hidden_size=4096, num_hidden_layers=3, num_attention_heads=64, head_dim=512,
                                   q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
                                   compress_ratios=[0, 4, 128, 0],
                                   rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                                 "beta_fast": 32, "beta_slow": 1}),
                              max_seq_len=a.max_l + 64)
    ops = backend_torch.torch_ops(dev)
    d, c, H = args.hidden_size, args.head_dim, args.num_attention_heads

    def bf16(*shape, s=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * s).to(torch.bfloat16).float()

    def fp8(N, K):  # an FP8 Weight with power-of-two block scales, as the checkpoint's
        w = (torch.randn(N, K, device=dev, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        return quant.Weight(w, torch.full((N // 128, K // 128), 2.0 ** -7 * (4096 / K) ** 0.5, device=dev))

    def f32(N, K):
        return quant.Weight(bf16(N, K, s=K ** -0.5), None)

    def comp(width, cw, m):
        return {"wkv": f32(width, d), "wgate": f32(width, d), "ape": bf16(m, width), "norm": 1 + bf16(cw, s=0.1)}

    def layer(kind):
        p = {"wq_a": fp8(args.q_lora_rank, d), "wq_b": fp8(H * c, args.q_lora_rank), "wkv": fp8(c, d),
             "wo_a": quant.Weight(backend_torch.dequant(fp8(args.o_groups * args.o_lora_rank, H * c // args.o_groups)), None),
             "wo_b": fp8(d, args.o_groups * args.o_lora_rank), "q_norm": 1 + bf16(args.q_lora_rank, s=0.1),
             "kv_norm": 1 + bf16(c, s=0.1), "attn_sink": bf16(H)}
        if kind != "sliding_attention":
            m = 4 if kind == "compressed_sparse_attention" else 128
            p["compressor"] = comp(2 * c if m == 4 else c, c, m)
        if kind == "compressed_sparse_attention":
            J, D = args.index_n_heads, args.index_head_dim
            p["indexer"] = {"wq_b": fp8(J * D, args.q_lora_rank), "weights_proj": f32(J, d), "compressor": comp(2 * D, D, 4)}
        return p

    def fill(cache, B, L, kind):  # the caches of a sequence at position L, random
        cache.ring.copy_(bf16(B, args.sliding_window, c))
        for st, m, cw in ((cache.comp, args.ratio(1 if kind == "compressed_sparse_attention" else 2), c),
                          (cache.idx, 4, args.index_head_dim)):
            if st is None:
                continue
            n = L // m
            st.reserve(n + STEPS + 8)
            st.buf[:, :n] = bf16(B, n, cw)
            st.n = n
            st.win.copy_(bf16(*st.win.shape))                       # the last 2m (m) positions' projections

    def sync_time(fn, reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)           # larger than the H200's L2

    def graph_time(fn, reps=20):  # median of replays of one captured call, L2 flushed before each
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        times = []
        for _ in range(reps):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        return sorted(times)[len(times) // 2]

    kinds = [k for k in KINDS if SHORT[k] in a.kinds.split(",")]
    ls = [L for L in LS if L <= a.max_l]
    res = {k: {w: {} for w in ("step_b1", "kernels_b1", f"step_b{BATCH}", "prefill")} for k in KINDS}
    for kind in kinds:
        i = KINDS.index(kind)
        m, freqs = args.ratio(i), ops.param(args.freqs(args.ratio(i) > 0))    # on the device, as the model holds it
        p = layer(kind)
        out = res[kind]
        for L in ls:
            for B in (1, BATCH):                           # decode: the step at position L, graph-replayed
                if B * (L // 4) * 4 * 640 > 60e9:          # the float32 caches must fit beside the rest
                    continue
                cache = ops.v4_cache(B, args, kind, p)
                x = bf16(B, 1, d)
                fill(cache, B, L, kind)
                pos = torch.full((1,), L, device=dev)
                out[f"step_b{B}"][str(L)] = 1e6 * graph_time(
                    lambda: ops.v4_attention_step(x, p, kind, m, pos, freqs, args, cache, True, True)) / B
                if B == 1:
                    out["kernels_b1"][str(L)] = 1e6 * graph_time(kernels_step(ops, args, cache, kind, m, L, gen))
                del cache
                torch.cuda.empty_cache()
            if L >= CHUNK:                                 # prefill: a 4K chunk ending at L
                cache = ops.v4_cache(1, args, kind, p)
                x = bf16(1, CHUNK, d)
                fill(cache, 1, L - CHUNK, kind)
                ops.v4_attention(x, p, kind, m, L - CHUNK, freqs, args, cache, True, True)
                fill(cache, 1, L - CHUNK, kind)
                out["prefill"][str(L)] = 1e6 * sync_time(
                    lambda: ops.v4_attention(x, p, kind, m, L - CHUNK, freqs, args, cache, True, True), 1) / CHUNK
                del cache
                torch.cuda.empty_cache()
            print(SHORT[kind], f"{L // 1024}K", {w: round(v[str(L)], 2) for w, v in out.items() if str(L) in v}, flush=True)
    parts = other_parts(ops, args, gen, graph_time)
    v32 = {}
    if FIG3.exists():
        f3 = json.loads(FIG3.read_text())["us_per_token"]["sparse"]
        v32 = {w: f3[w] for w in ("attn_decode_b1", "attn_prefill") if w in f3}
    d_ = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d"), chunk=CHUNK, batch=BATCH, steps=STEPS,
                        v32_from=FIG3.name),
              us_per_token=res, v32_attention=v32, kv_bytes_per_token=kv_bytes(), flops_1m=flops_per_token(1 << 20),
              parts_us=parts)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "v4.json").write_text(json.dumps(d_, indent=1))
    plot(d_, Path(a.out) / "v4.png")
    print(render(d_))


def other_parts(ops, args, gen, graph_time):
    """us per token, graph-replayed: the MoE sublayer (the experts stacked as the model holds them with the
    V4 kernels) and its first grouped GEMM alone, an mHC pair and the fp32 head."""
    import torch
    import backend_torch
    import kernels_v4
    import quant
    dev, d, I, E = ops.device, args.hidden_size, args.moe_intermediate_size, args.n_routed_experts

    def fp4(N, K):  # MXFP4: random code pairs, power-of-two scales per 32
        return quant.Weight(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=dev, generator=gen),
                            torch.full((N, K // 32), 2.0 ** -6, device=dev))

    def fp8(N, K):
        w = (torch.randn(N, K, device=dev, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        return quant.Weight(w, torch.full((N // 128, K // 128), 2.0 ** -7, device=dev))
    ffn = {"gate": quant.Weight(torch.randn(E, d, device=dev, generator=gen) * d ** -0.5, None),
           "gate_bias": torch.zeros(E, device=dev),
           "shared_experts": {"w1": fp8(I, d), "w3": fp8(I, d), "w2": fp8(d, I)}}
    # the second route: the experts re-encoded at load to 128x128 block FP8 (--experts fp8; random FP8 of the
    # same shapes here: the cost does not depend on the values), through the FP8 GEMM
    ffn8 = dict(ffn, **ops.v4_experts([{"w1": fp8(I, d), "w3": fp8(I, d), "w2": fp8(d, I)} for _ in range(E)]))
    ffn = dict(ffn, **ops.v4_experts([{"w1": fp4(I, d), "w3": fp4(I, d), "w2": fp4(d, I)} for _ in range(E)]))
    out = {}
    for B in (1, BATCH):
        x = torch.randn(B, d, device=dev, generator=gen).to(torch.bfloat16).float()
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        for key, f in (("moe", ffn), ("moe_fp8", ffn8)):
            out[f"{key}_b{B}"] = 1e6 * graph_time(lambda: ops.v4_moe(x, f, args, True, tok, True)) / B
        # the first grouped GEMM (gate | up) alone, each route, and the routing it needs: where the MoE's time goes
        idx = torch.stack([torch.randperm(E, device=dev, generator=gen)[:args.num_experts_per_tok] for _ in range(B)])
        rows, _, be = backend_torch.route(idx, E, 16)
        q, s = backend_torch.act_quant(x, kern=ops.kernels)
        out[f"route_b{B}"] = 1e6 * graph_time(lambda: backend_torch.route(idx, E, 16)) / B
        W = ffn["w13"]
        out[f"w13_fp4_b{B}"] = 1e6 * graph_time(lambda: kernels_v4.fp4_moe_gemm(q, s, W.w, W.scale, rows, be)) / B
        out[f"w13_fp8_b{B}"] = 1e6 * graph_time(lambda: backend_torch.grouped(q, s, ffn8["w13"], rows, be,
                                                                               kern=ops.kernels)) / B
        n = args.hc_mult
        X = torch.randn(B, n, d, device=dev, generator=gen).to(torch.bfloat16).float()
        fn = torch.randn((2 + n) * n, n * d, device=dev, generator=gen) * (n * d) ** -0.5
        base, scale = torch.zeros((2 + n) * n, device=dev), torch.ones(3, device=dev)

        def pair():
            _, post, comb, u = kernels_v4.hc_mix_pre(X, fn, base, scale, args, True)
            kernels_v4.hc_post(X, u, post, comb, True)
        out[f"hc_b{B}"] = 1e6 * graph_time(pair) / B
    head = torch.randn(129280, d, device=dev, generator=gen) * d ** -0.5
    h = torch.randn(1, d, device=dev, generator=gen)
    out["head_b1"] = 1e6 * graph_time(lambda: h @ head.T)
    del ffn, ffn8, head
    torch.cuda.empty_cache()
    print("parts", {k: round(v, 2) for k, v in out.items()}, flush=True)
    return out


def kernels_step(ops, args, cache, kind, m, L, gen):
    """One decode query's kernels at context L, on random inputs of the real shapes: CSA the indexer's
    scores over L/4 keys, the top-512 and the attention over window + picks; HCA / SWA the attention over
    the window (+ every complete window of 128)."""
    import torch
    import kernels_v4
    dev = cache.ring.device
    H, c, W = args.num_attention_heads, args.head_dim, args.sliding_window
    q = torch.randn(1, 1, H, c, device=dev, generator=gen).to(torch.bfloat16).float()
    KW = cache.ring
    KC = cache.comp.keys if cache.comp is not None else KW[:, :0]
    sink = torch.zeros(H, device=dev)
    win = torch.arange(W, device=dev, dtype=torch.int32).reshape(1, 1, W)
    if kind == "compressed_sparse_attention":
        J, D = args.index_n_heads, args.index_head_dim
        qi = torch.randn(1, 1, J, D, device=dev, generator=gen).to(torch.bfloat16).float()
        wi = torch.randn(1, 1, J, device=dev, generator=gen).to(torch.bfloat16).float()
        KI, k = cache.idx.keys, min(args.index_topk, L // 4)
        zero = torch.zeros(1, dtype=torch.long, device=dev)

        def step():
            I = kernels_v4.index_scores_v4(qi, wi, KI, L, 4, True)
            picks = ops.kernels.topk_indices(I, k, KI.shape[1])
            idx = torch.cat([win, picks + W], -1)
            kernels_v4.sparse_attention(q, KW, KC, idx, zero, sink, c ** -0.5, True, n_max=0)
        return step
    n = torch.full((1,), (L + 1) // m if m else 0, dtype=torch.long, device=dev)
    return lambda: kernels_v4.sparse_attention(q, KW, KC, win, n, sink, c ** -0.5, True, n_max=(L + 1) // m if m else 0)


if __name__ == "__main__":
    main()
