"""Tensor and expert parallelism (parallel.py) on 1 and N GPUs: prefill and decode tokens/s of a
checkpoint (a real-dimension one with random FP8 weights: `python checkpoint.py DIR --real-layers 2
--no-tokenizer --device cuda`), and the share of time spent in the collectives.

    python bench/bench_parallel.py --ckpt DIR --out OUT                     one process (1 GPU)
    torchrun --nproc-per-node 2 bench/bench_parallel.py --ckpt DIR --out OUT   two GPUs (NCCL)
    python bench/bench_parallel.py --render OUT/parallel_1.json OUT/parallel_2.json [--layers 61]

Each run writes OUT/parallel_<ranks>.json (rank 0). The communication share comes from a second pass
with every collective timed between synchronisations (which slows that pass a little; the tokens/s
are from the first, untimed pass). --render prints the table and an estimate for 8 GPUs and the
whole model (--layers), computed from the measured per-layer compute and communication, labelled as
an estimate: compute per layer scales as 1/ranks for the split parts, the collectives per layer are
taken as measured on 2 ranks (ring all-reduce time is nearly flat in the rank count at these sizes).
On the CPU (gloo) it runs too, for a smoke test.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def render(runs, layers):
    lines = ["| ranks | prefill tok/s | decode b1 tok/s | decode b32 tok/s | collectives, share of prefill / decode b1 / b32 |",
             "|---|---|---|---|---|"]
    for r in runs:
        m = r["measures"]
        lines.append(f"| {r['meta']['ranks']} | {m['prefill']['tok_s']:.0f} | {m['decode_b1']['tok_s']:.1f} | "
                     f"{m['decode_b32']['tok_s']:.0f} | " + " / ".join(f"{m[k]['comm_share']:.0%}" for k in
                                                                        ("prefill", "decode_b1", "decode_b32")) + " |")
    two = [r for r in runs if r["meta"]["ranks"] > 1]
    if two:
        r = two[0]
        n, L = r["meta"]["ranks"], r["meta"]["layers"]
        lines += ["", f"Estimate (not measured) for 8 ranks and {layers} layers, from the {n}-rank run's per-layer costs:"]
        for k in ("prefill", "decode_b1", "decode_b32"):
            m = r["measures"][k]
            per_tok = 1 / m["tok_s"] / L                              # seconds per token per layer
            comm, comp = per_tok * m["comm_share"], per_tok * (1 - m["comm_share"])
            est = layers * (comp * n / 8 + comm)
            lines.append(f"- {k}: {1 / est:.1f} tok/s (compute {layers * comp * n / 8 * 1e3:.2f} ms, "
                         f"collectives {layers * comm * 1e3:.2f} ms per token)")
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
    ap.add_argument("--layers", type=int, default=61, help="--render: layers of the whole model for the estimate")
    a = ap.parse_args()
    if a.render:
        print(render([json.loads(Path(p).read_text()) for p in a.render], a.layers))
        return
    import numpy as np
    import torch
    import parallel
    from model import Transformer

    ctx, device = parallel.init_from_env()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
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
        return out

    res = {}
    r = measure(1, a.prefill, a.steps)
    res["prefill"], res["decode_b1"] = r["prefill"], r["decode"]
    res["decode_b32"] = measure(a.batch, a.batch_prefill, a.steps)["decode"]      # (named b32 whatever --batch)
    ranks = ctx.world if ctx else 1
    if not ctx or ctx.rank == 0:
        meta = dict(ranks=ranks, layers=m.args.num_hidden_layers, ckpt=str(a.ckpt), date=time.strftime("%Y-%m-%d"),
                    gpu=torch.cuda.get_device_name() if device != "cpu" else "cpu", torch=torch.__version__,
                    prefill_tokens=a.prefill, steps=a.steps)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        run_ = dict(meta=meta, measures=res)
        (Path(a.out) / f"parallel_{ranks}.json").write_text(json.dumps(run_, indent=1))
        print(render([run_], m.args.num_hidden_layers))
    if ctx:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
