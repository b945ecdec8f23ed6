"""The DSA kernels of kernels_cuda.py on the shapes of spec/kernels.md §6-7, against PyTorch baselines
run in the same process, on one GPU, with the measured rooflines.

    indexer prefill   4096 queries at the end of an 8K / 32K / 64K causal context, 64 heads x 128, FP8;
                      FLOPs = 2 * valid pairs * 64 * 128 (DeepGEMM's count); baseline: bf16 einsum +
                      ReLU + weighted sum over heads, in 256-query chunks, no causal skip
    indexer decode    B rows of one query against their own L keys; bytes = B L (128 + 4) + 4 B L out;
                      baseline: the same in torch (bf16 matmul)
    top-k 2048        decode rows (B x L) and prefill rows (8192 causal rows of a 64K context); bytes = the
                      fp32 scores read once; baseline: torch.topk
    sparse MLA        decode over the packed FP8 656-byte cache (and bf16) and prefill over a bf16 cache,
                      128 heads, top-2048; FLOPs = 2 * 128 * valid selections * (576 + 512) (FlashMLA's
                      count); baselines: the dense absorbed attention in torch (decode), gather + bmm per
                      128-query chunk (prefill)

Each sequence has its own cache and the selected indices are random and distinct, the L2 is flushed
before every timed call (bench_gemm.timed), median of 20. Decode rows (and their baselines) are replayed from a CUDA
graph, as a decode step runs: Python's launch cost (tens of microseconds) is not theirs. The first shape of each kernel sweeps a few tile
configurations and the rest use the best; top-k rows and batch-1 rows of sparse MLA decode (latency) sweep
their own at every shape (top-k rows keep each configuration's time and the defaults'). `--smoke` runs tiny shapes (on the CPU under
TRITON_INTERPRET=1 the timings mean nothing: it only checks that the script runs).

    python bench/bench_dsa.py [--out DIR] [--smoke]      (writes DIR/dsa.json, prints the table)
    python bench/bench_dsa.py --render FILE.json          (the table of a stored run)
    python bench/bench_dsa.py --tilelang DIR              (and TileLang's kernels beside ours)
    python bench/bench_dsa.py --only top-k,mla-prefill    (some groups of rows: indexer-prefill, indexer-decode,
                                                           top-k, mla-decode, mla-prefill)

--tilelang DIR: a folder holding TileLang's `examples/deepseek_v32` modules (fp8_lighting_indexer.py,
topk_selector.py, sparse_mla_fwd_pipelined.py and the utils.py they import; TileLang itself installed:
../shared/anchors/README.md). They are imported from there, never copied into the project, and timed on
the same inputs with the same timer as ours (graph-replayed where ours is: top-k; eager for the
millisecond prefill calls), their conventions converted (selections padded with L instead of -1, the
causal end of each query row as an argument); each row also says whether the two agree (the same
top-k sets; the largest difference of the logits or outputs relative to their largest magnitude).
"""
import importlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm  # noqa: E402  (torch is imported only in main(): --render needs none)

IDX_CONFIGS = [dict(bq=bq, block_n=n, num_warps=w, num_stages=st) for bq, n, w, st in
               [(2, 64, 4, 3), (2, 64, 4, 4), (2, 128, 8, 3), (2, 32, 4, 4), (4, 64, 8, 3), (4, 32, 8, 4), (4, 64, 8, 4),
                (1, 128, 4, 4), (2, 64, 8, 3)]]
IDX_DECODE_CONFIGS = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in
                      [(64, 4, 3), (128, 4, 4), (128, 8, 3), (256, 8, 3), (64, 4, 5), (256, 4, 3)]]
# top-k, many decode rows (the first of each list: the defaults)
TOPK_CONFIGS = [dict(), dict(block=2048), dict(block=1024, num_warps=4), dict(block=4096, num_warps=16), dict(strided=True),
                dict(segments=1), dict(segments=4), dict(segments=8)]
# one decode row (latency): step 1's programs (segments: fewer than the default 8 make step 1 slower and
# step 2's join of the lists faster, RESULTS.md), the size of step 2's copied-out bin (few), step 2 by
# fixed stride or over the joined lists (strided), and the many-row choice (a sample of 2048, every row
# streamed) beside the default. Top-k rows sweep their configurations at every shape; each row keeps
# every configuration's time (sweep)
TOPK_B1_CONFIGS = [dict(), dict(block=2048), dict(block=1024), dict(block=4096, num_warps=16), dict(block=1024, num_warps=4),
                   dict(segments=2), dict(segments=4), dict(few=1024), dict(sample=2048, regs=0), dict(strided=False),
                   dict(strided=False, segments=4)]
MLA_CONFIGS = [dict(block_h=h, block_n=n, num_warps=w, num_stages=st, q_in_loop=ql, halves=hv) for h, n, w, st, ql, hv in
               [(64, 64, 8, 2, True, False), (64, 64, 8, 2, False, False), (64, 64, 8, 1, False, True),
                (64, 64, 8, 2, False, True), (64, 64, 8, 1, False, False), (64, 32, 8, 2, False, False),
                (64, 64, 8, 3, True, False), (128, 64, 16, 2, False, True)]]
MLA_B1_CONFIGS = [dict(c, splits=sp) for sp in (8, 16, 32) for c in
                  (dict(block_h=64, block_n=64, num_warps=8, num_stages=1), dict(block_h=64, block_n=32, num_warps=4, num_stages=1),
                   dict(block_h=128, block_n=32, num_warps=8, num_stages=1), dict(block_h=32, block_n=32, num_warps=4, num_stages=1))]


GROUPS = ("indexer-prefill", "indexer-decode", "top-k", "mla-decode", "mla-prefill")   # --only
TILELANG = ("fp8_lighting_indexer", "topk_selector", "sparse_mla_fwd_pipelined")   # TileLang's examples/deepseek_v32


def load_tilelang(folder):  # --tilelang: TileLang's example modules from the user's folder -> a namespace, or exit
    missing = [m + ".py" for m in TILELANG if not (Path(folder) / f"{m}.py").is_file()]
    if missing:
        sys.exit(f"bench_dsa: --tilelang {folder}: no {', '.join(missing)} there (copy TileLang's examples/deepseek_v32)")
    sys.path.append(str(Path(folder).resolve()))                # after the project's own modules
    try:
        return SimpleNamespace(**{m: importlib.import_module(m) for m in TILELANG})
    except Exception as e:                                   # TileLang not installed, or the examples' own imports
        sys.exit(f"bench_dsa: --tilelang {folder}: importing TileLang's modules failed: {type(e).__name__}: {e}")


def render(meta, rows):  # (bench_v4_kernels.py's too: its rows have no tile configurations, so no config column)
    roof = meta["roofline"]
    configs = any("config" in r for r in rows)
    side_by_side = any("tilelang_ms" in r for r in rows)
    out = [f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}"
           + (f", TileLang {meta['tilelang']}" if "tilelang" in meta else "")
           + (f", --only {meta['only']}" if "only" in meta else "") + "; measured roofline: FP8 "
           f"{roof['fp8_tflops']:.0f} TFLOP/s, bf16 {roof['bf16_tflops']:.0f} TFLOP/s, copy {roof['copy_gbs']:.0f} GB/s"
           f"{bench_gemm.floor_note(roof)}", "",
           "| kernel | shape | us | TFLOP/s | TB/s | of roofline | PyTorch baseline us | speed-up |"
           + (" TileLang us | speed vs TileLang | agree |" if side_by_side else "") + (" config |" if configs else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if side_by_side else "") + ("---|" if configs else "")]
    for r in rows:
        us = 1e3 * r["ms"]
        tf = r.get("flops", 0) / r["ms"] / 1e9
        tb = r.get("bytes", 0) / r["ms"] / 1e9
        peak = roof["fp8_tflops"] if r.get("fp8") else roof["bf16_tflops"]
        of = max(tf / peak, tb / (roof["copy_gbs"] / 1e3))
        base = f"{1e3 * r['baseline_ms']:.1f}" if r.get("baseline_ms") else "-"
        speed = f"{r['baseline_ms'] / r['ms']:.1f}x" if r.get("baseline_ms") else "-"
        cfg = ", ".join(f"{k}={v}" for k, v in r.get("config", {}).items()) or "defaults"
        if r.get("tilelang_ms"):
            side = f" {1e3 * r['tilelang_ms']:.1f} | {r['tilelang_ms'] / r['ms']:.2f}x | {r['tilelang_agree']} |"
        else:
            side = f" - | - | {r.get('tilelang_agree', '-')} |"
        out.append(f"| {r['kernel']} | {r['shape']} | {us:.1f} | {tf:.0f} | {tb:.2f} | {of:.2f} | {base} | {speed} |"
                   + (side if side_by_side else "") + (f" {cfg} |" if configs else ""))
    return "\n".join(out)


def main():
    def more(ap):
        ap.add_argument("--tilelang", metavar="DIR", help="time TileLang's examples/deepseek_v32 kernels from DIR beside ours")
        ap.add_argument("--only", metavar="GROUPS", help=f"a comma-separated subset of {', '.join(GROUPS)} (default: all)")
    a = bench_gemm.kernel_bench_cli(__doc__, "dsa.json", render, more=more)
    if a is None:                                                       # (no GPU: TRITON_INTERPRET=1)
        return
    only = a.only.split(",") if a.only else GROUPS
    if set(only) - set(GROUPS):
        sys.exit(f"bench_dsa: --only {a.only}: unknown {', '.join(sorted(set(only) - set(GROUPS)))} (groups: {', '.join(GROUPS)})")
    tilelang = load_tilelang(a.tilelang) if a.tilelang else None
    import torch
    import kernels_cuda
    import kernels_hopper
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    smoke = a.smoke

    def timed(fn, graph=False):
        """Median CUDA-event time with the L2 flushed (bench_gemm's); on the CPU one plain call. graph:
        the call replayed from a CUDA graph, as a decode step runs (no Python launch cost)."""
        if dev == "cuda" and graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return bench_gemm.timed(g.replay, reps=20, graph=False)
        if dev == "cuda":
            return bench_gemm.timed(fn, reps=20, graph=False)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def best(fn, configs, graph=False, sweep=None):  # -> (ms, config) of the fastest configuration (the first
        res = []                                               # under --smoke); sweep: a list given gets every one
        for c in configs[:1] if smoke else configs:
            try:
                res.append((timed(lambda: fn(**c), graph), c))
            except Exception as e:                                     # out of shared memory / registers
                print(f"config {c} failed: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        if sweep is not None:
            sweep += [[c, ms] for ms, c in res]
        return min(res, key=lambda r: r[0])

    def shapes(group, full, tiny):  # the shapes of a group of rows: none where --only leaves it out
        return [] if group not in only else tiny if smoke else full

    def add(row):  # a measured row, said at once (a whole run takes minutes)
        rows.append(row)
        print(f"{time.strftime('%H:%M:%S')} {row['kernel']} {row['shape']}: {1e3 * row['ms']:.1f} us", file=sys.stderr, flush=True)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    def beside(row, ours, theirs, agree, graph=False):  # --tilelang: TileLang's call on the same inputs, same timer
        try:
            row["tilelang_agree"] = agree(ours(), theirs())
            row["tilelang_ms"] = timed(theirs, graph)
            print(f"{time.strftime('%H:%M:%S')}   TileLang: {1e3 * row['tilelang_ms']:.1f} us, {row['tilelang_agree']}",
                  file=sys.stderr, flush=True)
        except Exception as e:                                      # the row keeps ours; the failure is said
            row["tilelang_agree"] = f"TileLang failed: {type(e).__name__}"
            print(f"TileLang, {row['kernel']} {row['shape']}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)

    def rel_diff(x, y):  # the same masked (-inf) positions, then the finite ones -> "rel diff 1.2e-07"
        x, y = x.float(), y.float()
        m = torch.isfinite(x)
        if x.shape != y.shape or not torch.equal(m, torch.isfinite(y)):
            return "different masks"
        return f"rel diff {((x - y)[m].abs().max() / y[m].abs().max()).item():.1e}"

    rows = []
    # ---- indexer scores, prefill and decode
    J, D = (64, 128) if not smoke else (16, 128)
    f8 = torch.float8_e4m3fn
    cfg = None
    for T, S in shapes("indexer-prefill", [(4096, 8192), (4096, 32768), (4096, 65536)], [(8, 40)]):
        q, k, w, ks = randn(1, T, J, D, dtype=f8), randn(1, S, D, dtype=f8), randn(1, T, J), torch.rand(1, S, device=dev) + 0.5
        fn = lambda **c: kernels_cuda.index_scores(q, w, k, ks, S - T, **c)
        ms, cfg = best(fn, IDX_CONFIGS) if cfg is None else (timed(lambda: fn(**cfg)), cfg)
        qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)

        def torch_scores(step=256):
            for t0 in range(0, T, step):
                s = torch.einsum("tjd,sd->tjs", qb[0, t0:t0 + step], kb[0]).relu_().float()
                (s * w[0, t0:t0 + step, :, None]).sum(1) * ks
        pairs = T * S - T * (T - 1) // 2
        add(dict(kernel="indexer prefill", shape=f"T={T} S={S}", ms=ms, baseline_ms=timed(torch_scores),
                 flops=2 * pairs * J * D, fp8=True, config=cfg))
        if tilelang:                                    # their row t sees keys [0, S - T + t]: ours, causal
            starts, ends = torch.zeros(T, dtype=torch.int32, device=dev), (S - T + 1 + torch.arange(T, device=dev)).int()
            beside(rows[-1], lambda: fn(**cfg)[0], lambda: tilelang.fp8_lighting_indexer.mqa_attn_return_logits_interface(
                q[0], k[0], ks[0], w[0], starts, ends), rel_diff)
    cfg = None
    for B, L in shapes("indexer-decode", [(64, 65536), (64, 16384), (8, 65536), (1, 65536), (1, 16384)], [(2, 40)]):
        q, k, w, ks = randn(B, 1, J, D, dtype=f8), randn(B, L, D, dtype=f8), randn(B, 1, J), torch.rand(B, L, device=dev) + 0.5
        fn = lambda **c: kernels_cuda.index_scores(q, w, k, ks, L - 1, **c)
        ms, cfg = best(fn, IDX_DECODE_CONFIGS, True) if cfg is None else (timed(lambda: fn(**cfg), True), cfg)
        qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
        base = timed(lambda: (torch.einsum("bjd,bsd->bjs", qb[:, 0], kb).relu_().float() * w[:, 0, :, None]).sum(1) * ks, True)
        add(dict(kernel="indexer decode", shape=f"B={B} L={L}", ms=ms, baseline_ms=base,
                 bytes=B * L * (D + 4 + 4), config=cfg))

    # ---- top-k 2048
    KT = 2048 if not smoke else 8
    for B, L in shapes("top-k", [(64, 65536), (1, 4096), (1, 16384), (1, 65536), (1, 131072), (1, 8192), (1, 12288),
                                 (64, 4096), (64, 16384), (64, 131072)],
                       [(2, 40), (1, 40)]):
        sc = randn(B, 1, L)
        fn = lambda **c: kernels_cuda.topk_indices(sc, KT, L - 1, **c)
        sweep = []
        ms, chosen = best(fn, TOPK_B1_CONFIGS if B == 1 else TOPK_CONFIGS, True, sweep)
        add(dict(kernel="top-k decode", shape=f"B={B} L={L} k={KT}", ms=ms,
                 baseline_ms=timed(lambda: torch.topk(sc, KT, dim=-1), True), bytes=4 * B * L, config=chosen,
                 default_ms=sweep[0][1], sweep=sweep))   # (each list's first: the defaults)
        if tilelang:                                    # each row's whole [0, L)
            s2 = sc[:, 0].contiguous()
            lo = torch.zeros(B, dtype=torch.int32, device=dev)
            hi = torch.full((B,), L, dtype=torch.int32, device=dev)
            beside(rows[-1], lambda: fn(**chosen)[:, 0], lambda: tilelang.topk_selector.tl_topk(s2, lo, hi, KT),
                   lambda x, y: "same sets" if torch.equal(x.sort(-1).values, y.sort(-1).values.to(x.dtype))
                   else "different sets", graph=True)
    for T, S in shapes("top-k", [(8192, 65536)], [(8, 40)]):
        sc = randn(1, T, S)
        ms = timed(lambda: kernels_cuda.topk_indices(sc, KT, S - T))          # the defaults for many rows
        add(dict(kernel="top-k prefill", shape=f"{T} rows, S={S} causal, k={KT}", ms=ms,
                 baseline_ms=timed(lambda: torch.topk(sc, KT, dim=-1)), bytes=4 * (T * S - T * (T - 1) // 2),
                 config=dict(block=512, num_warps=4)))
        del sc

    # ---- sparse MLA decode (packed FP8 and bf16 caches) and prefill (bf16 cache)
    H, C, R, K = (128, 512, 64, 2048) if not smoke else (16, 128, 64, 16)
    scale = (C // 4 + R) ** -0.5

    def cache_of(B, L, fmt):  # random latent rows; packed FP8: codes, ue8m0 scales, bf16 rope
        kv, pe = randn(B * L, C), randn(B * L, R)
        if fmt == "bf16":
            return torch.cat([kv, pe], -1).to(torch.bfloat16).reshape(B, L, C + R), kv, pe
        import quant_torch
        q8, s = quant_torch.act_quant(kv)
        rows8 = torch.cat([q8.view(torch.uint8), s.view(torch.uint8), pe.to(torch.bfloat16).view(torch.uint8)], -1)
        return rows8.reshape(B, L, -1), kv, pe

    def selection(B, T, L, K, causal_end=None):  # distinct random positions per query (sorted), -1 padded
        idx = torch.full((B, T, K), -1, dtype=torch.int32, device=dev)
        for b in range(B):
            for t in range(T):
                n = L if causal_end is None else causal_end + t + 1
                idx[b, t, :min(n, K)] = torch.randperm(n, device=dev, generator=gen)[:K].sort().values
        return idx

    cfgs = {}                                          # the best B > 1 configuration of each cache format
    for B, L, fmt in shapes("mla-decode", [(64, 32768, "fp8"), (128, 32768, "fp8"), (1, 65536, "fp8"), (64, 32768, "bf16"),
                                           (1, 65536, "bf16")], [(2, 40, "fp8")]):
        cache, kv, pe = cache_of(B, L, fmt)
        qa, qp = randn(B, 1, H, C, dtype=torch.bfloat16), randn(B, 1, H, R, dtype=torch.bfloat16)
        idx = selection(B, 1, L, K)
        fn = lambda **c: kernels_cuda.sparse_mla_decode(qa, qp, cache, idx, scale, L - 1, hopper=False, **c)
        if B == 1:                                     # latency: its own sweep, splits included
            ms, c1 = best(fn, MLA_B1_CONFIGS, True)
        else:
            cfg = cfgs.get(fmt)
            ms, cfgs[fmt] = best(fn, MLA_CONFIGS, True) if cfg is None else (timed(lambda: fn(**cfg), True), cfg)
        kvb, peb = kv.reshape(B, L, C).bfloat16(), pe.reshape(B, L, R).bfloat16()

        def dense():  # the dense absorbed attention over all L keys, in torch
            z = (torch.einsum("bhc,blc->bhl", qa[:, 0], kvb) + torch.einsum("bhr,blr->bhl", qp[:, 0], peb)).float() * scale
            return torch.einsum("bhl,blc->bhc", torch.softmax(z, -1).bfloat16(), kvb)
        base = timed(dense, True) if B * L <= 64 * 32768 else None
        add(dict(kernel=f"sparse MLA decode ({fmt} cache)", shape=f"B={B} L={L} topk={K}", ms=ms, baseline_ms=base,
                 flops=2 * B * H * K * (C + R + C), config=c1 if B == 1 else cfgs[fmt]))
        if kernels_hopper.takes(qa, qp, cache, idx) and kernels_cuda._default_splits(qa, idx, None) == 1:
            hop = lambda: kernels_cuda.sparse_mla_decode(qa, qp, cache, idx, scale, L - 1, hopper=True)  # Gluon: the
            same = all(map(torch.equal, hop(), fn(halves=False, late_sum=False)))    # plain kernel's bits, latent whole
            add(dict(kernel=f"sparse MLA decode ({fmt} cache), Hopper warp-specialised", shape=f"B={B} L={L} topk={K}",
                     ms=timed(hop, True), baseline_ms=base, flops=2 * B * H * K * (C + R + C),
                     config=dict(same_bits_as_plain=same)))
        del cache, kv, pe, kvb, peb
    cfg = None
    for T, L in shapes("mla-prefill", [(4096, 16384), (4096, 8192), (4096, 65536), (4096, 4096)], [(8, 40)]):
        cache, kv, pe = cache_of(1, L, "bf16")
        qa, qp = randn(1, T, H, C, dtype=torch.bfloat16), randn(1, T, H, R, dtype=torch.bfloat16)
        idx = selection(1, T, L, K, causal_end=L - T)              # early queries of a short context: fewer
        valid = int((idx >= 0).sum())
        fn = lambda **c: kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx, scale, L - T, hopper=False, **c)
        ms, cfg = best(fn, MLA_CONFIGS) if cfg is None else (timed(lambda: fn(**cfg)), cfg)
        rows_bf = cache[0]

        def gathered(step=128):  # gather + bmm per 128-query chunk (spec §7's PyTorch baseline)
            for t0 in range(0, T, step):
                sel = idx[0, t0:t0 + step]
                g = rows_bf[sel.clamp_min(0).long()]                                      # [t, K, C + R]
                q = torch.cat([qa[0, t0:t0 + step], qp[0, t0:t0 + step]], -1)           # [t, H, C + R]
                z = torch.bmm(q, g.transpose(1, 2)).float() * scale
                z = z.masked_fill(sel[:, None, :] < 0, float("-inf"))
                torch.bmm(torch.softmax(z, -1).bfloat16(), g[..., :C])
        base_ms = timed(gathered)
        add(dict(kernel="sparse MLA prefill (bf16 cache)", shape=f"T={T} L={L} topk={K}", ms=ms,
                 baseline_ms=base_ms, flops=2 * valid * H * (C + R + C), config=cfg))
        ours = [(rows[-1], lambda: fn(**cfg)[0])]
        if kernels_hopper.takes(qa, qp, cache, idx):   # the warp-specialised variant (Gluon): the plain kernel's
            hop = lambda: kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx, scale, L - T, hopper=True)   # bits
            same = all(map(torch.equal, hop(), kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx, scale, L - T,
                                                                                hopper=False)))   # (o, lse), default tiles
            add(dict(kernel="sparse MLA prefill (bf16 cache), Hopper warp-specialised", shape=f"T={T} L={L} topk={K}",
                     ms=timed(hop), baseline_ms=base_ms, flops=2 * valid * H * (C + R + C),
                     config=dict(same_bits_as_plain=same)))
            ours.append((rows[-1], lambda: hop()[0]))
        if tilelang:                                    # their kernel: q and key rows whole, selections padded with L
            qt, kvt = torch.cat([qa, qp], -1).contiguous(), cache[:, :, None, :].contiguous()
            it = torch.where(idx < 0, L, idx)[:, :, None, :].contiguous()
            q0, compiled = torch.tensor([L - T], dtype=torch.int32, device=dev), []

            def theirs():                               # compiled at the first call, then only run
                if not compiled:
                    compiled.append(tilelang.sparse_mla_fwd_pipelined.sparse_mla_fwd_interface(
                        qt, kvt, it, L - T, 1, sm_scale=scale, return_kernel=True))
                return compiled[0](qt, kvt, it, q0)[0]
            for row, call in ours:
                beside(row, call, theirs, rel_diff)
        del cache, kv, pe
    for T, L in shapes("mla-prefill", [(4096, 16384)], [(8, 40)]):   # the model's own cache: packed FP8 rows
        cache = cache_of(1, L, "fp8")[0]
        qa, qp = randn(1, T, H, C, dtype=torch.bfloat16), randn(1, T, H, R, dtype=torch.bfloat16)
        idx = selection(1, T, L, K, causal_end=L - T)
        flops = 2 * int((idx >= 0).sum()) * H * (C + R + C)
        fn = lambda **c: kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx, scale, L - T, hopper=False, **c)
        add(dict(kernel="sparse MLA prefill (fp8 cache)", shape=f"T={T} L={L} topk={K}", ms=timed(fn), flops=flops,
                 config=dict(defaults=True)))
        if kernels_hopper.takes(qa, qp, cache, idx):
            hop = lambda: kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx, scale, L - T, hopper=True)
            same = all(map(torch.equal, hop(), fn(halves=False, late_sum=False)))
            add(dict(kernel="sparse MLA prefill (fp8 cache), Hopper warp-specialised", shape=f"T={T} L={L} topk={K}",
                     ms=timed(hop), flops=flops, config=dict(same_bits_as_plain=same)))
        del cache

    if dev == "cuda":  # registers and spills of the compiled kernels (stderr)
        for name in ("_index_scores_kernel", "_topk_kernel", "_sparse_mla_kernel"):
            fn = getattr(kernels_cuda, name)
            for per_dev in getattr(fn, "device_caches", {}).values():
                for ck in (per_dev[0].values() if isinstance(per_dev, tuple) else []):
                    print(name, "regs", getattr(ck, "n_regs", "?"), "spills", getattr(ck, "n_spills", "?"),
                          "warps", getattr(getattr(ck, "metadata", None), "num_warps", "?"), file=sys.stderr)
    version = None
    if tilelang:
        from importlib.metadata import PackageNotFoundError, version as package_version
        try:
            version = package_version("tilelang")
        except PackageNotFoundError:                    # stand-ins (the tests)
            version = "not installed"
    more = dict({"tilelang": version} if version else {}, **({"only": a.only} if a.only else {}))
    bench_gemm.write_kernel_run(a.out, "dsa.json", rows, smoke, render, **more)


if __name__ == "__main__":
    main()
