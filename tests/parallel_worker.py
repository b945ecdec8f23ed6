"""Run by tests/test_parallel.py under torch.distributed.run (gloo on the CPU, or NCCL with device cuda): one rank of the parallel
model on a checkpoint; rank 0 saves the logits of a prefill (every position), of a chunk after the
cache and of greedy decode steps to OUT (.npz) for the test to compare with one process (or, on GPUs,
decode steps plain and replayed from a CUDA graph, for the test to compare with each other)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel  # noqa: E402
from model import Transformer  # noqa: E402


def script(m):  # the fixed run both sides make: prefill, a chunk after the cache, 6 greedy decode steps
    tokens = np.random.default_rng(0).integers(0, m.args.vocab_size, (2, 24))
    prefill = m.forward(tokens[:, :16], all_positions=True)
    chunk = m.forward(tokens[:, 16:20], start_pos=16, all_positions=True)
    nxt, steps = chunk[:, -1].argmax(-1, keepdim=True), []
    for s in range(6):
        logits = m.forward(nxt, start_pos=20 + s)
        steps.append(logits)
        nxt = logits.argmax(-1, keepdim=True)
    return dict(prefill=prefill.cpu().numpy(), chunk=chunk.cpu().numpy(), steps=torch.stack(steps, 1).cpu().numpy())


def moe_op(m):  # one MoE layer's op on a fixed input (official numerics: the grouped expert GEMM)
    d = m.args.hidden_size
    x = torch.from_numpy(np.round(np.sin(np.arange(6 * d) * 0.1).reshape(6, d) * 64) / 64).float()
    return dict(moe=m.opts.ops.moe(x.to(m.opts.ops.device), m.w["layers"][1]["ffn"], m.args, m.opts.official).cpu().numpy())


def graph_decode(m):  # official numerics on GPUs: decode steps plain, then replayed from one CUDA graph
    import backend_torch                                          # on the plain run's tokens (teacher-forced)
    prompt = np.random.default_rng(1).integers(0, m.args.vocab_size, (2, 12))
    m.reserve(2, 24)
    feed, runs = [], {}
    for how in ("plain", "graph"):
        nxt = m.forward(prompt).argmax(-1, keepdim=True)
        graph = backend_torch.GraphDecoder(m, 2, 12) if how == "graph" else None
        steps = []
        for s in range(6):
            tok = nxt if how == "plain" else feed[s]
            logits = graph(tok, 12 + s) if graph else m.forward(tok, start_pos=12 + s)
            steps.append(logits.float().clone())
            if how == "plain":
                feed.append(tok)
                nxt = logits.argmax(-1, keepdim=True)
        runs[how] = torch.stack(steps, 1).cpu().numpy()
    return runs


def v4_sublayers(m):  # DeepSeek-V4: each layer's attention (dense over its windows) and MoE on one fixed input
    a, ops = m.args, m.ops
    x = np.round(np.sin(np.arange(2 * 12 * a.hidden_size) * 0.1).reshape(2, 12, -1) * 64) / 64
    x = ops.param(x.astype(np.float32))
    ids = ops.tokens(np.arange(24).reshape(2, 12) * 37 % a.vocab_size).reshape(-1)
    out = {}
    for i, lw in enumerate(m.w["layers"]):
        kind, r = a.layer_types[i], a.ratio(i)
        cache = ops.v4_cache(2, a, kind, lw["attn"])
        out[f"attn{i}"] = ops.v4_attention(x, lw["attn"], kind, r, 0, m.freqs[r > 0], a, cache, False, m.official).cpu().numpy()
        out[f"moe{i}"] = ops.v4_moe(x.reshape(24, -1), lw["ffn"], a, m.official, ids, m.official).cpu().numpy()
    return out


def main(ckpt, out, numerics, attention, what="script", device="cpu"):
    ctx, device = parallel.init_from_env(device)
    m = Transformer.from_pretrained(ckpt, backend="torch", device=device, numerics=numerics, attention=attention,
                                    parallel=ctx)
    res = {"script": script, "moe": moe_op, "graph": graph_decode, "v4_sublayers": v4_sublayers}[what](m)
    if dist.get_rank() == 0:
        np.savez(out, **res)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
