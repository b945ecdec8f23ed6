"""Tensor and expert parallelism (parallel.py) on 1 and N GPUs: prefill and decode tokens/s of a
checkpoint (a real-dimension one with random FP8 weights: `python checkpoint.py DIR --real-layers 2
--no-tokenizer --device cuda`), and the share of time spent in the collectives.

    python bench/bench_parallel.py --ckpt DIR --out OUT                     one process (1 GPU)
    torchrun --nproc-per-node 2 bench/bench_parallel.py --ckpt DIR --out OUT   two GPUs (NCCL)
    python bench/bench_parallel.py --render OUT/parallel_1.json OUT/parallel_2.json [--layers N]

Each run writes OUT/parallel_<ranks>.json (rank 0). The communication share comes from a second pass
with every collective timed between synchronisations (which slows that pass a little; the tokens/s
are from the first, untimed pass). On GPUs decode is measured a second way too: replayed from one
CUDA graph (backend_torch.GraphDecoder, the collectives captured in it), which removes Python's launch
cost; the collectives cannot be timed inside a graph, so those rows have no share.

Everything is measured twice: on the model, and on the same model cut to its first layer, so that one
layer's cost (the difference) and the rest (embedding, head) are apart. --render prints the table and,
given a 1-rank and a 2-rank run, an estimate for 8 GPUs and the whole model (--layers; default the
model's: 61 for DeepSeek-V3.2-Exp, 43 for V4-Flash), labelled as an estimate: each part's per-token
time fitted to t(r) = a + b / r over the two runs (see fit8). DeepSeek-V4-Flash checkpoints run too
(`python checkpoint.py DIR --v4 --real-layers 4 --no-tokenizer --device cuda`: SWA, SWA, CSA, HCA); its
first layer, the one the cut model keeps, is a window-only one, cheaper than the average layer, so the
"rest" of its estimate is a little low. On the CPU (gloo) it runs too, for a smoke test.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fit8(t1, t2, n=8):
    """Per-token seconds on 1 and 2 ranks -> on n ranks, from t(r) = a + b / r fitted to the two (b: the
    split work; a: what does not shrink, with the collectives). The collectives are absent on 1 rank, so
    the fit carries 1 + 3/4 times the 2-rank collectives to n = 8: the ring all-reduce's 2(n-1)/n."""
    b = 2 * (t1 - t2)
    return (t1 - b) + b / n


LAYERS = {"deepseek_v32": 61, "deepseek_v4": 43}                    # the whole models' layers (estimate)


def render(runs, layers=None):
    lines = ["| ranks | prefill tok/s | decode b1 tok/s | decode b32 tok/s | collectives, share of prefill / decode b1 / b32 "
             "| decode b1, CUDA graph | decode b32, CUDA graph |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["measures"]
        g = [f"{m[k]['tok_s']:.1f}" if k in m else "-" for k in ("decode_b1_graph", "decode_b32_graph")]
        lines.append(f"| {r['meta']['ranks']} | {m['prefill']['tok_s']:.0f} | {m['decode_b1']['tok_s']:.1f} | "
                     f"{m['decode_b32']['tok_s']:.0f} | " + " / ".join(f"{m[k]['comm_share']:.0%}" for k in
                                                                        ("prefill", "decode_b1", "decode_b32"))
                     + f" | {g[0]} | {g[1]} |")
    one = [r for r in runs if r["meta"]["ranks"] == 1]
    two = [r for r in runs if r["meta"]["ranks"] == 2]
    if one and two and "cut" in one[0] and "cut" in two[0]:
        L = one[0]["meta"]["layers"]
        layers = layers or LAYERS[one[0]["meta"].get("model", "deepseek_v32")]
        lines += ["", f"Estimate (not measured) for 8 ranks and {layers} layers: per-token time of one layer = (model "
                  f"- the model cut to its first layer) / {L - 1}, the rest (embedding, head) = the cut model less one "
                  "such layer; each fitted to t(r) = a + b / r on the 1- and 2-rank runs:"]
        for k in ("prefill", "decode_b1_graph", "decode_b32_graph", "decode_b1", "decode_b32"):
            if k not in one[0]["measures"] or k not in two[0]["measures"]:
                continue
            per = []
            for r in (one[0], two[0]):
                full, cut = 1 / r["measures"][k]["tok_s"], 1 / r["cut"][k]["tok_s"]
                layer = (full - cut) / (L - 1)
                per.append((cut - layer, layer))
            fixed8, layer8 = fit8(per[0][0], per[1][0]), fit8(per[0][1], per[1][1])
            t8 = fixed8 + layers * layer8
            lines.append(f"- {k}: {1 / t8:.1f} tok/s ({layer8 * 1e3:.3f} ms a layer, {fixed8 * 1e3:.3f} ms the rest, "
                         f"per token; 1 rank: {per[0][1] * 1e3:.3f} ms a layer)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="checkpoint folder")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prefill", type=int, default=4096, help="prefill tokens (default 4096)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps (default 16)")
    ap.add_argument("--batch", type=int, default=32, help="the batched decode's batch (default 32)")
    ap.add_argument("--batch-prefill", type=int, default=256, help="its prompts' length (default 256)")
    ap.add_argument("--render", nargs="+", help="stored parallel_<ranks>.json runs -> the table and the estimate")
    ap.add_argument("--layers", type=int, default=None,
                    help="--render: layers of the whole model for the estimate (default: 61 for V3.2, 43 for V4)")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                    help="cpu: run the ranks on the CPU (gloo) even where there are GPUs (default: a GPU per rank if any)")
    a = ap.parse_args()
    if a.render:
        print(render([json.loads(Path(p).read_text()) for p in a.render], a.layers))
        return
    import numpy as np
    import torch
    import parallel
    from model import Transformer

    ctx, device = parallel.init_from_env(a.device)
    device = device or a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = Transformer.from_pretrained(a.ckpt, backend="torch", device=device, parallel=ctx)
    V = m.args.vocab_size
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def run(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def measure(B, T, steps):
        tokens = rng.integers(0, V, (B, T + steps))

        def prefill():
            m.forward(tokens[:, :T])

        def decode():
            for s in range(steps):
                m.forward(tokens[:, T + s:T + s + 1], start_pos=T + s)
        out = {}
        for name, fn, n in (("prefill", prefill, B * T), ("decode", decode, B * steps)):
            if name == "decode":
                prefill()
            fn()                                                   # warm: compile, allocate
            if name == "decode":
                prefill()
            t = run(fn)
            if ctx:
                ctx.timing, ctx.comm_s = True, 0.0
                if name == "decode":
                    prefill()
                    ctx.comm_s = 0.0
                t2 = run(fn)
                ctx.timing = False
                share = ctx.comm_s / t2
            else:
                share = 0.0
            out[name] = {"tok_s": n / t, "comm_share": share}
        if device != "cpu":                                        # decode replayed from one CUDA graph
            import backend_torch
            m.reserve(B, T + steps)
            prefill()
            g = backend_torch.GraphDecoder(m, B, T)
            dev_tok = torch.as_tensor(tokens, device=device)

            def graph_decode():
                for s in range(steps):
                    g(dev_tok[:, T + s:T + s + 1], T + s)
            graph_decode()
            out["decode_graph"] = {"tok_s": B * steps / run(graph_decode)}
        return out

    def all_measures():
        res = {}
        r = measure(1, a.prefill, a.steps)
        res["prefill"], res["decode_b1"] = r["prefill"], r["decode"]
        r32 = measure(a.batch, a.batch_prefill, a.steps)
        res["decode_b32"] = r32["decode"]                                          # (named b32 whatever --batch)
        if "decode_graph" in r:
            res["decode_b1_graph"], res["decode_b32_graph"] = r["decode_graph"], r32["decode_graph"]
        return res

    res = all_measures()
    args, L = m.args, m.args.num_hidden_layers             # (V4's per-layer lists are cut with it: restore args whole)
    m.w["layers"], m.args, m.caches = m.w["layers"][:1], dataclasses.replace(m.args, num_hidden_layers=1), []
    cut = all_measures()                                   # the same model cut to its first layer
    m.args = args
    ranks = ctx.world if ctx else 1
    if not ctx or ctx.rank == 0:
        meta = dict(ranks=ranks, model=m.args.model_type, layers=m.args.num_hidden_layers, ckpt=str(a.ckpt),
                    date=time.strftime("%Y-%m-%d"),
                    gpu=torch.cuda.get_device_name() if device != "cpu" else "cpu", torch=torch.__version__,
                    prefill_tokens=a.prefill, steps=a.steps)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        run_ = dict(meta=meta, measures=res, cut=cut)
        (Path(a.out) / f"parallel_{ranks}.json").write_text(json.dumps(run_, indent=1))
        print(render([run_], L))
    if ctx:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
