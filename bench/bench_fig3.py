"""The DeepSeek-V3.2-Exp paper's Figure 3 on one GPU: the cost of the token at position L for one layer
at the real dimensions (MLA + lightning indexer + a MoE FFN with 256 experts; random FP8 weights),
with attention="sparse" (DSA through the kernels) and attention="dense" (V3.1-Terminus behaviour) on
the same weights, for L = 4K .. 128K.

    prefill   a 4096-token chunk ending at L (start_pos = L - 4096), time / 4096. Dense: the MHA form
              through PyTorch's fused scaled_dot_product_attention in query chunks; sparse: the
              indexer kernels, top-k and the sparse MLA prefill kernel (absorbed form)
    decode    one step at context L from a CUDA graph, time / batch, at batch 1 and at batch 64.
              Dense: the same latent kernel walking every causal position (absorbed MLA over the FP8
              cache: the best dense decode the project has); sparse: indexer + top-k + sparse MLA

The caches hold random values (the costs do not depend on them); official numerics. The vocabulary
is cut to 1024 so the head's GEMV does not swamp one layer's decode.

    python bench/bench_fig3.py [--out DIR]        writes DIR/fig3.json, DIR/fig3.png (if matplotlib is there)
    python bench/bench_fig3.py --render FILE.json [--png FILE.png]
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LS = [4096, 8192, 16384, 32768, 65536, 131072]
CHUNK = 4096
BATCH = 64
PAPER = {"prefill": 3.5, "decode": 8.5}          # dense / sparse cost at 128K, H800 (spec/kernels.md A20)


def render(d):
    lines = [f"{d['meta']['gpu']}, {d['meta']['date']}, torch {d['meta']['torch']}, triton {d['meta']['triton']}; one "
             "layer of DeepSeek-V3.2-Exp (MLA + indexer + 256-expert MoE), official numerics; microseconds per token", "",
             "| L | prefill dense | prefill sparse | dense/sparse | decode b1 dense | decode b1 sparse | dense/sparse "
             f"| decode b{BATCH} dense | decode b{BATCH} sparse | dense/sparse |", "|---|---|---|---|---|---|---|---|---|---|"]
    r = d["us_per_token"]

    def rows(whats):  # one row per L: dense, sparse, their ratio for each measure
        for L in LS:
            cells = []
            for what in whats:
                dn, sp = r["dense"][what].get(str(L)), r["sparse"][what].get(str(L))
                cells += [f"{dn:.2f}" if dn else "-", f"{sp:.2f}" if sp else "-", f"{dn / sp:.2f}x" if dn and sp else "-"]
            lines.append(f"| {L // 1024}K | " + " | ".join(cells) + " |")
    rows(("prefill", "decode_b1", f"decode_b{BATCH}"))
    if "attn_prefill" in r["dense"]:
        lines += ["", "The attention sublayer alone (MLA + indexer; the MoE FFN costs the same in both modes):", "",
                  lines[2].replace("decode b", "attention decode b").replace("prefill", "attention prefill"), lines[3]]
        rows(("attn_prefill", "attn_decode_b1", f"attn_decode_b{BATCH}"))
    return "\n".join(lines)


def pyplot():  # matplotlib's pyplot without a display, or None (said once) where it is not installed
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the table and the JSON are written)", file=sys.stderr)
        return None
    return plt


def context_axis(ax, ls, xlabel, ylabel, title):  # a log2 axis of contexts 4K, 8K, ... and the panel's labels
    ax.set_xscale("log", base=2)
    ax.set_xticks([L / 1024 for L in ls], [f"{L // 1024}K" for L in ls])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def plot(d, png):
    plt = pyplot()
    if plt is None:
        return False
    r = d["us_per_token"]
    rows = 2 if "attn_prefill" in r["dense"] else 1
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.8 * rows), squeeze=False)
    panels = [("prefill", "layer: prefill (4K chunk ending at L)"), ("decode_b1", "layer: decode, batch 1"),
              (f"decode_b{BATCH}", f"layer: decode, batch {BATCH}")]
    if rows == 2:
        panels += [("attn_" + w, t.replace("layer", "attention only")) for w, t in panels]
    for ax, (what, title) in zip(axes.flat, panels):
        for mode, style in (("dense", "o-"), ("sparse", "s-")):
            xs = [L for L in LS if str(L) in r[mode][what]]
            ax.plot([x / 1024 for x in xs], [r[mode][what][str(x)] for x in xs], style,
                    label="dense (V3.1-style MLA)" if mode == "dense" else "sparse (DSA kernels)")
        context_axis(ax, LS, "token position L", "us per token, one layer", title)
    fig.suptitle(f"Cost of the token at position L, one DeepSeek-V3.2-Exp layer on one {d['meta']['gpu']} "
                 f"({d['meta']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def fill_caches(m, gen):  # random but valid cache contents everywhere (FP8 codes without NaN, scales 1/16)
    import torch
    for c in m.caches:
        n = c.latent.shape[:2]
        C = m.args.kv_lora_rank
        c.latent[..., :C] = torch.randint(0, 256, (*n, C), device="cuda", dtype=torch.uint8, generator=gen) & 0x77
        c.latent[..., C:C + 16] = torch.full((*n, 4), 1 / 16, device="cuda").view(torch.uint8)
        c.latent[..., C + 16:] = torch.randn(*n, 64, device="cuda", generator=gen).to(torch.bfloat16).view(torch.uint8)
        c.idx.k.copy_(torch.randn(c.idx.k.shape, device="cuda", generator=gen).to(c.idx.k.dtype))
        c.idx.k_scale.fill_(1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for fig3.json and fig3.png")
    ap.add_argument("--render", help="print the table of a stored fig3.json (and --png FILE: plot it)")
    ap.add_argument("--png")
    ap.add_argument("--max-l", type=int, default=LS[-1], help="largest L to measure (default 128K)")
    ap.add_argument("--profile", action="store_true", help="only print the GPU kernels of one batch-1 decode step "
                    "at the largest L: the whole layer (sparse) and the attention sublayer (sparse and dense), "
                    "torch.profiler, kernel times summed by name; and the whole step's graph-replayed time")
    a = ap.parse_args()
    if a.render:
        d = json.loads(Path(a.render).read_text())
        print(render(d))
        if a.png:
            plot(d, a.png)
        return
    import numpy as np
    import torch
    import triton
    import attention
    import backend_torch
    import bench_model
    import rope
    from config import ModelArgs
    from model import Transformer

    args = ModelArgs.from_config(dict(bench_model.REAL, num_hidden_layers=1, first_k_dense_replace=0, vocab_size=1024),
                                 max_seq_len=a.max_l + 64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = bench_model.random_weights(args, "cuda", False, gen)
    ops = backend_torch.torch_ops("cuda")
    assert ops.fused, "the DSA kernels are not in use"
    ls = [L for L in LS if L <= a.max_l]
    res = {}

    fill = lambda m: fill_caches(m, gen)               # noqa: E731

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    def attention_step(m, B, pos):  # one decode step of the attention sublayer alone, captured
        x = torch.randn(B, 1, args.hidden_size, device="cuda", generator=gen).to(torch.bfloat16).float()
        cap = m.caches[0].cap
        step = lambda: attention.mla_forward(x, m.w["layers"][0]["attn"], m.caches[0], pos, cap,   # noqa: E731
                                             m.rope_table[0][pos.reshape(1)], m.rope_table[1][pos.reshape(1)], args, m.opts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        return g, step

    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for mode in ("sparse", "dense"):
            m = Transformer(args, w, numerics="official", attention_mode=mode, ops=ops)
            m.reserve(1, args.max_seq_len)
            fill(m)
            m.cached_len = ls[-1]
            m.rope_table = ops.angles(*rope.rope_angles(m.freqs, np.arange(m.caches[0].cap)))
            pos = torch.full((), ls[-1], dtype=torch.long, device="cuda")
            ga, step = attention_step(m, 1, pos)
            if mode == "sparse":                         # the whole layer's step: eager kernels, then its graph
                tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
                for _ in range(3):
                    m.decode_static(tok, pos)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    m.decode_static(tok, pos)
                    torch.cuda.synchronize()
                g = backend_torch.GraphDecoder(m, 1, ls[-1])
                t = timed(lambda: g(tok, ls[-1]), 20)
                print(f"--- sparse, the whole layer's decode step, batch 1, L = {ls[-1]}: {1e6 * t:.1f} us graph-replayed")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
                del g
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(f"--- {mode}, attention sublayer, batch 1, L = {ls[-1]}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
            del ga, m
            torch.cuda.empty_cache()
        return
    for mode in ("sparse", "dense"):
        m = Transformer(args, w, numerics="official", attention_mode=mode, ops=ops)
        out = res[mode] = {k: {} for k in ("prefill", "decode_b1", f"decode_b{BATCH}",
                                           "attn_prefill", "attn_decode_b1", f"attn_decode_b{BATCH}")}
        m.reserve(1, args.max_seq_len)
        fill(m)
        tok = torch.randint(0, args.vocab_size, (1, CHUNK), device="cuda", generator=gen)
        x = torch.randn(1, CHUNK, args.hidden_size, device="cuda", generator=gen).to(torch.bfloat16).float()
        for L in ls:                                     # a 4K chunk ending at L: the layer, then its attention alone
            m.cached_len = L - CHUNK
            out["prefill"][str(L)] = 1e6 * timed(lambda: m.forward(tok, start_pos=L - CHUNK), 2 if L > 32768 else 3) / CHUNK
            cos, sin = ops.angles(*rope.rope_angles(m.freqs, np.arange(L - CHUNK, L)))
            out["attn_prefill"][str(L)] = 1e6 * timed(lambda: attention.mla_forward(
                x, m.w["layers"][0]["attn"], m.caches[0], L - CHUNK, L, cos, sin, args, m.opts), 2 if L > 32768 else 3) / CHUNK
            print(mode, "prefill", L, f"{out['prefill'][str(L)]:.2f} us/token, attention {out['attn_prefill'][str(L)]:.2f}",
                  flush=True)
        for B in (1, BATCH):
            if B > 1:
                m.caches = None
                m.reserve(B, args.max_seq_len)
                fill(m)
            m.cached_len = ls[0]
            g = backend_torch.GraphDecoder(m, B, ls[0])
            nxt = torch.zeros(B, 1, dtype=torch.long, device="cuda")
            pos = torch.full((), ls[0], dtype=torch.long, device="cuda")
            ga, _ = attention_step(m, B, pos)
            for L in ls:
                out[f"decode_b{B}"][str(L)] = 1e6 * timed(lambda: g(nxt, L), 10) / B
                pos.fill_(L)
                out[f"attn_decode_b{B}"][str(L)] = 1e6 * timed(ga.replay, 10) / B
                print(mode, f"decode b{B}", L, f"{out[f'decode_b{B}'][str(L)]:.2f} us/token, attention "
                      f"{out[f'attn_decode_b{B}'][str(L)]:.2f}", flush=True)
            del g, ga
        m.caches = None
        del m
        torch.cuda.empty_cache()
    d = dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       date=time.strftime("%Y-%m-%d"), chunk=CHUNK, batch=BATCH), us_per_token=res)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "fig3.json").write_text(json.dumps(d, indent=1))
    plot(d, Path(a.out) / "fig3.png")
    print(render(d))
    top = str(ls[-1])
    for what, paper in (("prefill", PAPER["prefill"]), ("decode_b1", PAPER["decode"]), (f"decode_b{BATCH}", PAPER["decode"]),
                        ("attn_prefill", PAPER["prefill"]), ("attn_decode_b1", PAPER["decode"]),
                        (f"attn_decode_b{BATCH}", PAPER["decode"])):
        r = res["dense"][what][top] / res["sparse"][what][top]
        print(f"{what} at {int(top) // 1024}K: sparse is {r:.2f}x cheaper than dense (paper, whole model on H800: ~{paper}x)")


if __name__ == "__main__":
    main()
