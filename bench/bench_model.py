"""The whole model at DeepSeek-V3.2-Exp's real dimensions (hidden 7168, 128 heads, 256 experts, index
top-k 2048) with random FP8 weights, as many layers as fit one GPU: prefill tokens/s at 4K and 16K
context and decode tokens/s at batch 1 and 32, for the fast path (FP8 weights, Triton kernels)
against the named baseline measured in the same run: the same model with bf16 weights and no
kernels (plain torch matmuls).

    python bench/bench_model.py [--layers 4] [--out DIR]     prints a table; writes DIR/model.json

Weights are drawn on the device (no checkpoint): FP8 codes from N(0, 1) with power-of-two block
scales chosen so activations keep their size; the baseline's bf16 weights are the same values.
Prefill runs in chunks (--chunk tokens, start_pos > 0): the baseline's MHA-mode reference attention
materialises [heads, chunk, context] scores (the fast path now runs the DSA kernels; the stored run in
RESULTS.md predates them).
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import backend_torch  # noqa: E402
import checkpoint  # noqa: E402
import quant  # noqa: E402
import quant_torch  # noqa: E402
from config import ModelArgs  # noqa: E402
from model import Transformer  # noqa: E402

REAL = dict(checkpoint.REAL_DIMS, quantization_config={"quant_method": "fp8", "scale_fmt": "ue8m0"})


def random_weights(args, dev, bf16, gen):
    def lin(n, k):
        w = torch.randn(n, k, device=dev, generator=gen).to(torch.float8_e4m3fn)
        s = torch.full((-(-n // 128), -(-k // 128)), 2.0 ** -round(0.5 * __import__("math").log2(k)), device=dev)
        if bf16:                                              # the baseline: the same values in bf16, no scales
            return quant.Weight(quant_torch.dequant(quant.Weight(w, s)).to(torch.bfloat16), None)
        return quant.Weight(w, s)

    def vec(n):
        return torch.ones(n, device=dev)

    def mlp(inter):
        return {"w1": lin(inter, D), "w3": lin(inter, D), "w2": lin(D, inter)}

    a = args
    D, H = a.hidden_size, a.num_attention_heads
    layers = []
    for i in range(a.num_hidden_layers):
        attn = {"wq_a": lin(a.q_lora_rank, D), "wq_b": lin(H * 192, a.q_lora_rank), "wkv_a": lin(576, D),
                "wkv_b": lin(H * 256, a.kv_lora_rank), "wo": lin(D, H * 128), "q_norm": vec(a.q_lora_rank),
                "kv_norm": vec(a.kv_lora_rank),
                "indexer": {"wq_b": lin(64 * 128, a.q_lora_rank), "wk": lin(128, D), "k_norm": vec(128),
                            "k_norm_bias": torch.zeros(128, device=dev),
                            "weights_proj": quant.Weight(torch.randn(64, D, device=dev, generator=gen).to(torch.bfloat16) / 85, None)}}
        if i < a.first_k_dense_replace:
            ffn = mlp(a.intermediate_size)
        else:                                            # the torch backend's layout: experts stacked
            E, I = a.n_routed_experts, a.moe_intermediate_size
            w13 = [lin(2 * I, D) for _ in range(E)]
            w2 = [lin(D, I) for _ in range(E)]
            stack = lambda ws: quant.Weight(torch.stack([w.w for w in ws]),                         # noqa: E731
                                            None if ws[0].scale is None else torch.stack([w.scale for w in ws]))
            ffn = {"gate": quant.Weight(torch.randn(E, D, device=dev, generator=gen).to(torch.bfloat16) / 85, None),
                   "gate_bias": torch.zeros(E, device=dev), "w13": stack(w13), "w2": stack(w2),
                   "shared_experts": mlp(I)}
            del w13, w2
        layers.append({"attn_norm": vec(D), "ffn_norm": vec(D), "attn": attn, "ffn": ffn})
    emb = torch.randn(a.vocab_size, D, device=dev, generator=gen).to(torch.bfloat16)
    return {"embed": emb, "head": emb, "norm": vec(D), "layers": layers}


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(m, args, chunk, gen, graphs):
    out = {}
    V = args.vocab_size
    warm = torch.randint(0, V, (2, 2 * chunk), device="cuda", generator=gen)   # compile kernels, warm allocator
    m.forward(warm[:, :chunk])
    m.forward(warm[:, chunk:], start_pos=chunk)
    for s in range(3):
        m.forward(warm[:, :1], start_pos=2 * chunk + s)
    for ctx in (4096, 16384):                                 # prefill one sequence, in chunks
        tok = torch.randint(0, V, (1, ctx), device="cuda", generator=gen)

        def prefill():
            for p in range(0, ctx, chunk):
                m.forward(tok[:, p:p + chunk], start_pos=p)
        prefill()                                             # untimed: the kernel variants of longer contexts
        out[f"prefill_{ctx}"] = ctx / sync_time(prefill)      # (top-k's lists from 8K keys) compile here
    for B, ctx in ((1, 4096), (32, 1024)):                    # decode after a prefill of ctx tokens
        tok = torch.randint(0, V, (B, ctx), device="cuda", generator=gen)
        m.caches = None
        m.reserve(B, ctx + 64)                                # caches preallocated for prefill + decode
        for p in range(0, ctx, chunk // B if B > 1 else chunk):
            m.forward(tok[:, p:p + max(chunk // B, 1)], start_pos=p)
        steps = 16
        nxt = tok[:, -1:]
        for s in range(steps):                                # untimed: compiles every kernel variant these
            m.forward(nxt, start_pos=ctx + s)                 # positions use (tiles, integer specialisation)

        def decode():
            nonlocal nxt
            for s in range(steps):
                nxt = m.forward(nxt, start_pos=ctx + s).argmax(-1, keepdim=True)
        out[f"decode_b{B}"] = B * steps / sync_time(decode)
        if not graphs:                                        # the baseline's expert loop is not capturable
            continue
        pos0 = ctx + steps                                    # the same decode, replayed from a CUDA graph
        m.reserve(B, pos0 + steps + 1)
        graph = backend_torch.GraphDecoder(m, B, pos0)

        def decode_graph():
            nonlocal nxt
            for s in range(steps):
                nxt = graph(nxt, pos0 + s).argmax(-1, keepdim=True)
        out[f"decode_b{B}_cuda_graph"] = B * steps / sync_time(decode_graph)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the real model to build (default 4)")
    ap.add_argument("--dense-layers", type=int, default=1, help="how many of them are dense-FFN layers (default 1)")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for model.json")
    a = ap.parse_args()
    args = ModelArgs.from_config(dict(REAL, num_hidden_layers=a.layers, first_k_dense_replace=a.dense_layers),
                                 max_seq_len=32768)
    results = {}
    for name, bf16 in (("fp8+kernels", False), ("bf16, no kernels", True)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = random_weights(args, "cuda", bf16, gen)
        ops = no_kernel_ops() if bf16 else backend_torch.torch_ops("cuda")
        m = Transformer(args, w, numerics="official", ops=ops)
        print(f"{name}: {torch.cuda.memory_allocated() / 2**30:.0f} GiB of weights", flush=True)
        results[name] = measure(m, args, a.chunk, torch.Generator(device="cuda").manual_seed(1), graphs=not bf16)
        print(name, json.dumps(results[name]), flush=True)
        del m, w
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                date=time.strftime("%Y-%m-%d"), layers=a.layers, dense_layers=a.dense_layers, chunk=a.chunk)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "model.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    f, b = results["fp8+kernels"], results["bf16, no kernels"]
    print(f"\n{meta['gpu']}, {meta['date']}, {a.layers} layers ({a.dense_layers} dense) of DeepSeek-V3.2-Exp, official numerics")
    print("| measure | fp8 + kernels tok/s | bf16, no kernels tok/s | ratio |\n|---|---|---|---|")
    for k in f:
        base = b.get(k, b.get(k.replace("_cuda_graph", "")))          # graph decode against the plain baseline
        print(f"| {k} | {f[k]:.1f} | {base:.1f} | {f[k] / base:.2f} |")


def no_kernel_ops():  # the baseline's op table: plain torch on the GPU (bf16 weights: bf16 GEMMs), no Triton
    return backend_torch.torch_ops("cuda", kernels=False)


if __name__ == "__main__":
    main()
