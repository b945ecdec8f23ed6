"""Programmatic dependent launch (kernels_fp8.pdl) on and off, side by side in one process on one GPU:
one V3.2 layer's batch-1 decode step at 128K (real dimensions, random FP8 weights, official numerics,
graph-replayed: the median of 7 means of 50 replays), its logits with and without (equal, or the script
says so), top-k at batch 1 and 64 and the block-FP8 GEMMs at M = 1 as the model calls them (split K and
its combine; both through bench_gemm.timed: graph-replayed, L2 flushed). Each is measured on, off, on,
off.

    python bench/bench_pdl.py [--out DIR]        prints a table; writes DIR/pdl.json
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
L = 131072                                              # the layer step's context


def layer_step(torch, m, on):  # -> (the step's us, its logits), with PDL on or off
    import backend_torch
    import kernels_fp8
    kernels_fp8.USE_PDL = on
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    for _ in range(3):
        m.decode_static(tok, torch.full((), L, dtype=torch.long, device="cuda"))
    g = backend_torch.GraphDecoder(m, 1, L)
    for _ in range(20):
        g(tok, L)
    torch.cuda.synchronize()
    means = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(50):
            g(tok, L)
        torch.cuda.synchronize()
        means.append((time.perf_counter() - t) / 50 * 1e6)
    return sorted(means)[3], g(tok, L).clone()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for pdl.json")
    a = ap.parse_args()
    import torch
    import triton
    import backend_torch
    import bench_fig3
    import bench_gemm
    import bench_model
    import kernels_cuda
    import kernels_fp8
    import numpy as np
    import rope
    from config import ModelArgs
    from model import Transformer
    bench_gemm.torch = torch
    res = {}
    args = ModelArgs.from_config(dict(bench_model.REAL, num_hidden_layers=1, first_k_dense_replace=0, vocab_size=1024),
                                 max_seq_len=L + 64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops = backend_torch.torch_ops("cuda")
    m = Transformer(args, bench_model.random_weights(args, "cuda", False, gen), numerics="official",
                    attention_mode="sparse", ops=ops)
    m.reserve(1, args.max_seq_len)
    bench_fig3.fill_caches(m, gen)
    m.cached_len = L
    m.rope_table = ops.angles(*rope.rope_angles(m.freqs, np.arange(m.caches[0].cap)))
    logits = {}
    for on in (True, False, True, False):
        t, logits[on] = layer_step(torch, m, on)
        res.setdefault(f"layer step, batch 1, L = 128K|{on}", []).append(t)
        print("layer step", "on" if on else "off", f"{t:.1f} us", flush=True)
    res["logits equal on / off"] = bool(torch.equal(logits[True], logits[False]))
    for B, S in ((1, 4096), (1, 16384), (1, 65536), (1, 131072), (64, 16384), (64, 65536)):
        sc = torch.randn(B, 1, S, device="cuda", generator=gen)
        for on in (True, False, True, False):
            kernels_fp8.USE_PDL = on
            res.setdefault(f"top-k 2048, {B} x {S}|{on}", []).append(
                1e3 * bench_gemm.timed(lambda: kernels_cuda.topk_indices(sc, 2048, S - 1)))
    for name in ("o", "q_a+kv_a+idx_wk", "q_b+idx_wq_b", "mlp_w1", "kv_b"):
        N, K = bench_gemm.SHAPES[name]
        x, sx = kernels_fp8.act_quant(torch.randn(1, K, device="cuda"))
        w = (torch.randn(N, K, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        sw = torch.rand(-(-N // 128), K // 128, device="cuda") + 0.5
        for on in (True, False, True, False):                    # as backend_torch's linears call it
            kernels_fp8.USE_PDL = on
            res.setdefault(f"fp8_gemm M = 1, {name} [{N}, {K}]|{on}", []).append(1e3 * bench_gemm.timed(
                lambda: kernels_fp8.fp8_gemm(x, sx, w, sw, out_dtype=torch.float32, bf16_values=True)))
    kernels_fp8.USE_PDL = True
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "pdl.json").write_text(json.dumps(dict(meta=meta, res=res), indent=1))
    print("\n".join(render(meta, res)))


def render(meta, res):
    lines = [f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; us, each measured "
             "on, off, on, off", "", "| measure | PDL on us | PDL off us |", "|---|---|---|"]
    for k in dict.fromkeys(k.split("|")[0] for k in res if "|" in k):
        on, off = (", ".join(f"{t:.1f}" for t in res[f"{k}|{v}"]) for v in (True, False))
        lines.append(f"| {k} | {on} | {off} |")
    lines.append(f"logits equal with and without: {res['logits equal on / off']}")
    return lines


if __name__ == "__main__":
    main()
