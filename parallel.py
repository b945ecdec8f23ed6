"""Tensor and expert parallelism with torch.distributed, applied to the model from outside: the model's
code (model.py, attention.py, indexer.py, moe.py) is the single-GPU code; this module slices its
weights and wraps the torch backend's op table with the collectives (the official code's layout).

    attention   heads split: W^UQ (wq_b) and W^UKV (wkv_b) by output rows, W^O (wo) by input columns
                (partial products, summed over ranks); the latent cache, W^DQ, W^DKV and the
                indexer are whole on every rank, and rank 0's selection is broadcast, so every rank
                attends to the same keys
    dense MLP   w1, w3 by rows (intermediate columns), w2 by input columns (summed over ranks)
    MoE         the router whole on every rank; routed experts split across ranks (expert parallel:
                rank r holds experts r*E/n .. (r+1)*E/n - 1), each rank's weighted sum over its own
                experts summed over ranks; the shared expert split like a dense MLP
    vocabulary  the embedding and the head split by rows: a masked lookup summed over ranks, and
                the head's logit slices gathered

DeepSeek-V4 (shard_v4; the same wrapped ops): the 64 query heads split, with their output groups
(wq_b by rows, the sinks, W^OA by its groups' rows, W^OB by the groups' input columns, summed over
ranks); the shared key (wkv), the compressors, the CSA indexer, mHC, the embedding and the fp32 head
whole on every rank (so every rank picks the same keys); the routed experts split as above (expert
parallel) and the shared expert like a dense MLP. Each rank's attention and MoE outputs are its part
of a sum over ranks (official numerics: the parts rounded to bf16 before it, as the official code's).

The number of ranks must divide the heads (and V4's output groups), the routed experts and the
vocabulary (V3.2), and every slice of an FP8 weight must cover whole 128x128 scale blocks (true for
DeepSeek-V3.2-Exp up to 8 ranks, for V4-Flash up to 8); other layouts are refused with a message. Slicing happens on the checkpoint's memory-mapped arrays,
so each rank reads only its own slices from the shards.

    ctx = parallel.Parallel.from_env()          # after torch.distributed.init_process_group
    m = Transformer.from_pretrained(path, backend="torch", device=..., parallel=ctx)
"""
import dataclasses
import os
import time

import numpy as np
import torch
import torch.distributed as dist

import backend_torch
import quant

BLOCK = 128


class RowShard(quant.Weight):
    """A weight split by its input columns: its product is this rank's part of the sum over ranks."""
    __slots__ = ()


class ShardError(ValueError):
    pass


class Parallel:
    """rank, world: this process and the group's size (torch.distributed's default group)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.whole_vocab = False                         # shard_v4: the embedding stays whole on every rank
        self.timing, self.comm_s = False, 0.0            # bench_parallel: time spent in the collectives

    def _comm(self, fn, *a):                             # one collective (timed between syncs when asked)
        if not self.timing:
            return fn(*a)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t = time.perf_counter()
        fn(*a)
        sync()
        self.comm_s += time.perf_counter() - t

    @classmethod
    def from_env(cls):
        return cls(dist.get_rank(), dist.get_world_size())

    # -------------------------------------------------------------------------
    # weights

    def _part(self, n, what):  # [lo, hi) of this rank's share of n
        if n % self.world:
            raise ShardError(f"{what} ({n}) is not divisible by the number of ranks ({self.world})")
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k

    def _rows(self, W, lo, hi, name):  # output rows lo:hi (and their scale rows)
        if W.scale is not None and (lo % BLOCK or hi % BLOCK):
            raise ShardError(f"{name}: rows {lo}:{hi} of this rank's slice cut a {BLOCK}x{BLOCK} FP8 scale block "
                             f"(choose a number of ranks that keeps every slice on whole blocks)")
        return quant.Weight(W.w[lo:hi], None if W.scale is None else W.scale[lo // BLOCK:hi // BLOCK])

    def _cols(self, W, lo, hi, name):  # input columns lo:hi (and their scale columns): a RowShard
        if W.scale is not None and (lo % BLOCK or hi % BLOCK):
            raise ShardError(f"{name}: columns {lo}:{hi} of this rank's slice cut a {BLOCK}x{BLOCK} FP8 scale block "
                             f"(choose a number of ranks that keeps every slice on whole blocks)")
        return RowShard(W.w[:, lo:hi], None if W.scale is None else W.scale[:, lo // BLOCK:hi // BLOCK])

    def _mlp(self, p, name):  # w1, w3 by rows; w2 by columns
        lo, hi = self._part(p["w1"].w.shape[0], f"{name} intermediate size")
        return {"w1": self._rows(p["w1"], lo, hi, name + ".w1"), "w3": self._rows(p["w3"], lo, hi, name + ".w3"),
                "w2": self._cols(p["w2"], lo, hi, name + ".w2")}

    def shard(self, weights, args):
        """The checkpoint's weights (NumPy, memory-mapped) and args -> this rank's slices and the
        args its model code sees (its own head count)."""
        a, world = args, self.world
        H, N, R, V = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        h0, h1 = self._part(H, "num_attention_heads")
        self._part(a.vocab_size, "vocab_size")
        if a.n_routed_experts and a.first_k_dense_replace < a.num_hidden_layers:
            self._part(a.n_routed_experts, "n_routed_experts")
        out = dict(weights)
        v0, v1 = self._part(weights["embed"].shape[0], "vocab_size")
        out["embed"] = weights["embed"][v0:v1]
        out["head"] = weights["head"][v0:v1]
        layers = []
        for i, lw in enumerate(weights["layers"]):
            at = dict(lw["attn"])
            at["wq_b"] = self._rows(at["wq_b"], h0 * (N + R), h1 * (N + R), f"layer {i} wq_b")
            at["wkv_b"] = self._rows(at["wkv_b"], h0 * (N + V), h1 * (N + V), f"layer {i} wkv_b")
            at["wo"] = self._cols(at["wo"], h0 * V, h1 * V, f"layer {i} wo")
            ffn = lw["ffn"]
            if "experts" in ffn:
                e0, e1 = self._part(len(ffn["experts"]), "n_routed_experts")
                ffn = dict(ffn, experts=ffn["experts"][e0:e1], expert_range=(e0, e1),
                           shared_experts=self._mlp(ffn["shared_experts"], f"layer {i} shared expert"))
            else:
                ffn = self._mlp(ffn, f"layer {i} mlp")
            layers.append(dict(lw, attn=at, ffn=ffn))
        out["layers"] = layers
        return out, dataclasses.replace(args, num_attention_heads=H // world)

    def shard_v4(self, weights, args):
        """DeepSeek-V4's weights (NumPy, as model_v4.load_layer gives them) and args -> this rank's
        slices and the args its model code sees (its heads and output groups)."""
        a = args
        H, c, g, dg = a.num_attention_heads, a.head_dim, a.o_groups, a.o_lora_rank
        h0, h1 = self._part(H, "num_attention_heads")
        g0, g1 = self._part(g, "o_groups")
        e0, e1 = self._part(a.n_routed_experts, "n_routed_experts")
        self.whole_vocab = True
        layers = []
        for i, lw in enumerate(weights["layers"]):
            at = dict(lw["attn"], attn_sink=lw["attn"]["attn_sink"][h0:h1])
            at["wq_b"] = self._rows(at["wq_b"], h0 * c, h1 * c, f"layer {i} wq_b")
            at["wo_a"] = self._rows(at["wo_a"], g0 * dg, g1 * dg, f"layer {i} wo_a")
            at["wo_b"] = self._cols(at["wo_b"], g0 * dg, g1 * dg, f"layer {i} wo_b")
            ffn = dict(lw["ffn"], experts=lw["ffn"]["experts"][e0:e1], expert_range=(e0, e1),
                       shared_experts=self._mlp(lw["ffn"]["shared_experts"], f"layer {i} shared expert"))
            layers.append(dict(lw, attn=at, ffn=ffn))
        return dict(weights, layers=layers), dataclasses.replace(args, num_attention_heads=H // self.world,
                                                                 o_groups=g // self.world)

    # -------------------------------------------------------------------------
    # the op table with the collectives

    def wrap(self, ops):
        """The torch op table of this rank, with the sums and gathers over ranks where the sliced
        weights need them."""
        if ops.name != "torch":
            raise ShardError("tensor/expert parallelism runs on the torch backend (backend='torch')")
        base, world, rank = ops, self.world, self.rank

        comm = self._comm

        def all_sum(y):
            y = y.contiguous()
            comm(dist.all_reduce, y)
            return y

        def weight(W):                                   # keep the RowShard mark through the device copy
            out = base.weight(W)
            return RowShard(*out) if isinstance(W, RowShard) else out

        def linear(x, W, official):
            y = base.linear(x, W, official)
            if isinstance(W, RowShard):                  # this rank's part of the sum (official: bf16 sum)
                y = all_sum(y)
                return base.bf16_round(y) if official and W.scale is not None else y
            return y

        def linears(x, Ws, official):                    # one GEMM only where no weight is a RowShard
            if any(isinstance(W, RowShard) for W in Ws):
                return [linear(x, W, official) for W in Ws]
            return base.linears(x, Ws, official)

        def embed(table, tokens):                        # rows v0:v1 of the vocabulary here
            n = table.shape[0]
            local = tokens - rank * n
            here = (local >= 0) & (local < n)
            return all_sum(base.embed(table, local.clamp(0, n - 1)) * here[..., None])

        def head(h, w):                                  # this rank's logit columns, gathered
            part = base.head(h, w).contiguous()
            parts = [torch.empty_like(part) for _ in range(world)]
            comm(dist.all_gather, parts, part)
            return torch.cat(parts, -1)

        def select(*a, **kw):                            # rank 0's selection, on every rank
            sel = base.select(*a, **kw)
            flag = sel.dtype == torch.bool
            sel = sel.to(torch.uint8) if flag else sel.contiguous()
            comm(dist.broadcast, sel, 0)
            return sel.bool() if flag else sel

        def moe(x, p, args, official):
            """Routed experts of this rank (expert parallel): the weighted sum over each token's
            experts held here, in expert-id order in fp32, summed over ranks; then the shared expert
            (split by columns, summed inside its w2)."""
            w, idx = base.gate(x, p["gate"].w, p.get("gate_bias"), args)           # every expert, every rank
            e0, e1 = p["expert_range"]
            mine = (idx >= e0) & (idx < e1)
            if base.kernels is not None and official and p["w13"].scale is not None:   # the grouped GEMM
                out = backend_torch.routed_grouped(x, p, torch.where(mine, idx - e0, e1 - e0), elsewhere=True,
                                                   kern=base.kernels)
            else:                                                                   # one expert at a time
                out = backend_torch.routed_loop(x, p, idx, official, e0, kern=base.kernels)
            out = torch.where(mine[..., None], out, 0.0)                           # pairs routed elsewhere: nothing
            y = all_sum(backend_torch.weighted_sum(w, idx, out)) + mlp(x, p["shared_experts"], official)
            return base.bf16_round(y) if official else base.no_round(y)

        def mlp(x, p, official):                          # the base MLP through the wrapped linear
            rnd = base.bf16_round if official else base.no_round
            a, b = linear(x, p["w1"], official), linear(x, p["w3"], official)
            return linear(rnd(torch.nn.functional.silu(a) * b), p["w2"], official)

        def param(a):                                     # the expert range stays a pair of ints
            return a if isinstance(a, tuple) else base.param(a)

        # V4's sub-layers call backend_torch's linear themselves, not this table's: W^OB's and the shared
        # expert's RowShard products come back as this rank's parts, summed here once
        def v4_attention(x, p, kind, m, start_pos, freqs, args, cache, sparse=True, official=False):
            """This rank's heads and output groups: its part of W^OB's product, summed over ranks."""
            y = all_sum(base.v4_attention(x, p, kind, m, start_pos, freqs, args, cache, sparse, official))
            return base.bf16_round(y) if official else y

        def v4_moe(x, p, args, official, tokens, weight_inside=False):
            """This rank's routed experts and its columns of the shared expert, summed over ranks."""
            y = all_sum(base.v4_moe(x, p, args, official, tokens, weight_inside))
            return base.bf16_round(y) if official else y

        def v4_attention_step(x, p, kind, m, pos, freqs, args, cache, sparse=True, official=False):
            y = all_sum(base.v4_attention_step(x, p, kind, m, pos, freqs, args, cache, sparse, official))
            return base.bf16_round(y) if official else y

        v4 = {} if base.v4_attention is None else dict(v4_attention=v4_attention, v4_moe=v4_moe)
        if base.v4_attention_step is not None:
            v4["v4_attention_step"] = v4_attention_step
        if self.whole_vocab:                              # V4: the table is whole here, no sum over ranks
            embed = base.embed
        return dataclasses.replace(base, weight=weight, linear=linear, linears=linears, embed=embed, head=head,
                                   select=select, moe=moe, mlp=mlp, param=param, **v4)


def init_from_env(device=None):
    """torchrun's environment -> an initialised default group, the device of this rank, and its
    Parallel; (None, None) when not launched by torchrun (one process). device: None picks one GPU
    per rank (NCCL) where there are GPUs, else the CPU (gloo); "cpu" runs the ranks on the CPU even
    where there are GPUs. More ranks on this host than it has GPUs is refused, before any GPU is touched."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, None
    if device not in (None, "cpu", "cuda"):
        raise ShardError(f"--device {device}: under torchrun each rank takes its own GPU (--device cuda) "
                         f"or the CPU (--device cpu)")
    cuda = device != "cpu" and torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ShardError("--device cuda: no GPU is visible on this host (run the ranks on the CPU with --device cpu)")
    if cuda:
        ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), torch.cuda.device_count()
        if ranks > gpus:
            raise ShardError(f"torchrun started {ranks} ranks on this host but it has {gpus} GPU(s): use "
                             f"--nproc-per-node {gpus} or fewer, or run the ranks on the CPU with --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return Parallel.from_env(), (f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
