"""kernels_v4.py's kernels on DeepSeek-V4-Flash's shapes, each against a PyTorch baseline run in the same
process (the torch path's own ops for the same step: backend_torch with the kernels switched off, or the
plain torch formulation named in the row) and the measured rooflines, official numerics, on one GPU.

    mHC pair          hc_mix_pre + hc_post, 4 streams of 4096; bytes: X read twice, Φ once, X' written
    compress_keys     CSA (m = 4, overlapping, c = 512) and HCA (m = 128, c = 512): one key (decode) and
                      a 4096-token chunk's keys (prefill); bytes: the windows' projections read, the keys
                      written; baseline: backend_torch.window_keys without the kernel
    index_scores_v4   64 heads of 128 against L/4 compressed keys (fp32); FLOPs 2 T n J D; bytes: the keys
    top-512           kernels_cuda.topk_indices over L/4 scores; bytes: the scores; baseline: torch.topk
    sparse_attention  64 heads of 512 against the window (128) + 512 picks (CSA), or + every complete window
                      of 128 (HCA); FLOPs 4 H c keys; bytes: the keys read (fp32); baseline: gather, einsum,
                      softmax with the sink, einsum in torch
    fp4_moe_gemm      the routed experts' gate and up GEMM (6 of 256 experts a token, 4096 -> 2 x 2048), each
                      kernel: the decode GEMV (1 and 32 tokens), the MMA's fp16 and int8 routes (and 4096
                      tokens, eager); bytes: the routed experts' FP4 codes and scales; baseline: the routed
                      experts held in bf16 (dequantized at load, not timed: 4x the FP4 bytes), each one's
                      tokens through torch.matmul

Decode rows are replayed from a CUDA graph, prefill rows timed eagerly; the L2 flushed before every timed
call (bench_gemm.timed). "of roofline": the larger of achieved FLOP/s over the measured bf16 peak and
bytes/s over the measured copy bandwidth. `--smoke` runs tiny shapes (on the CPU under TRITON_INTERPRET=1
the timings mean nothing: it only checks that the script runs).

    python bench/bench_v4_kernels.py [--out DIR] [--smoke]      writes DIR/v4_kernels.json, prints the table
    python bench/bench_v4_kernels.py --render FILE.json
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gemm  # noqa: E402  (torch is imported only in main(): --render needs none)
from bench_dsa import render  # noqa: E402  the same table


def main():
    a = bench_gemm.kernel_bench_cli(__doc__, "v4_kernels.json", render)    # (no GPU: TRITON_INTERPRET=1)
    if a is None:
        return
    import torch
    import backend_torch
    import kernels_cuda
    import kernels_v4
    import quant
    from config import V4Args
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    smoke = a.smoke

    def timed(fn, graph):  # ms: graph-replayed (decode) or eager, L2 flushed (bench_gemm); on the CPU one call
        if dev != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench_gemm.timed(fn, reps=10, graph=graph)

    def randn(*shape, s=1.0):  # bf16 values, as float32
        return (torch.randn(*shape, device=dev, generator=gen) * s).to(torch.bfloat16).float()

    rows = []

    def row(kernel, shape, fn, base, graph, flops=0, nbytes=0):
        rows.append(dict(kernel=kernel, shape=shape, ms=timed(fn, graph), baseline_ms=timed(base, graph) if base else None,
                         flops=flops, bytes=nbytes))
        print(rows[-1], file=sys.stderr, flush=True)

    d, n = (4096, 4) if not smoke else (256, 4)
    args = V4Args.from_config(dict(vocab_size=1024, hidden_size=d, num_hidden_layers=3, num_attention_heads=64, head_dim=512,
                                   q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
                                   compress_ratios=[0, 4, 128, 0]))                     # mHC's fields: V4-Flash's
    # ---- mHC: the pre-mix, Sinkhorn and collapse, then the post-mix
    R = (2 + n) * n
    fn_, base_, alpha = randn(R, n * d, s=(n * d) ** -0.5), randn(R, s=0.5), torch.rand(3, device=dev, generator=gen) * 2
    for M in (1, 4096) if not smoke else (1, 8):
        X = randn(M, n, d)

        def pair(v4k):
            _, post, comb, u = backend_torch.hc_mix_pre(X, fn_, base_, alpha, args, True, v4k=v4k)
            backend_torch.hc_post(X, u, post, comb, True, v4k=v4k)
        row("mHC pair (hc_mix_pre + hc_post)", f"M={M}", lambda: pair(kernels_cuda), lambda: pair(None), M == 1,
            flops=2 * M * R * n * d, nbytes=4 * (2 * M * n * d + R * n * d + M * n * d))

    # ---- the compressors' keys
    c, Rr = (512, 64) if not smoke else (64, 16)
    norm = 1 + randn(c, s=0.1)
    for name, m, chunk in (("CSA", 4, 4096), ("HCA", 128, 4096)) if not smoke else (("CSA", 4, 16), ("HCA", 16, 32)):
        overlap = m == 4
        h = 2 * c if overlap else c
        for k in (1, chunk // m):
            full, Cp, Zp = randn(1, k * m, 2 * h), randn(1, m, h), randn(1, m, h)
            pos = m * torch.arange(k, device=dev)
            freqs = torch.rand(Rr // 2, device=dev, generator=gen)
            keys = lambda v4k: backend_torch.window_keys(full, Cp, Zp, {"norm": norm}, m, overlap, pos, freqs, 1e-6,
                                                          backend_torch.bf16_round, None, v4k)
            row(f"compress_keys ({name}, m={m})", f"{k} key(s)", lambda: keys(kernels_cuda), lambda: keys(None), k == 1,
                nbytes=4 * (k * m * 2 * h + k * c))                 # about the rows read (CSA: half of each
                #                                                     window's C^a | C^b pair, as much of the one before)

    # ---- the CSA indexer's scores and top-k, the sparse attention
    J, D, H, W, K = (64, 128, 64, 128, 512) if not smoke else (8, 64, 8, 16, 8)
    Ls = (131072, 1048576) if not smoke else (256,)
    for L in Ls:
        nk = L // 4
        KI = randn(1, nk, D)
        for T in (1, 4096) if not smoke else (1, 16):
            q, w = randn(1, T, J, D), randn(1, T, J)

            def torch_scores():
                qk = backend_torch.bf16_round(torch.einsum("btjd,bsd->btjs", q, KI))
                return backend_torch.bf16_round((backend_torch.bf16_round(qk.clamp_min(0) * w[..., None])).sum(2))
            if T == 1 or L == Ls[0]:
                row("index_scores_v4", f"T={T} n={nk} (L={L // 1024}K)" if L >= 1024 else f"T={T} n={nk}",
                    lambda: kernels_v4.index_scores_v4(q, w, KI, L - T, 4, True), torch_scores if T * nk * J <= 1 << 28 else None,
                    T == 1, flops=2 * T * nk * J * D, nbytes=4 * nk * D)
        sc = randn(1, 1, nk)
        row("top-k (kernels_cuda.topk_indices)", f"n={nk} k={K}", lambda: kernels_cuda.topk_indices(sc, K, nk),
            lambda: torch.topk(sc, K, dim=-1), True, nbytes=4 * nk)
    cw = 512 if not smoke else 64
    sink, scale = randn(H, s=0.5), cw ** -0.5
    for name, L in (("SWA", 0), ("CSA", 131072), ("HCA", 1048576)) if not smoke else (("SWA", 0), ("CSA", 256), ("HCA", 256)):
        nc = L // 4 if name == "CSA" else L // 128
        KW, KC = randn(1, W, cw), randn(1, max(nc, 1), cw)
        q = randn(1, 1, H, cw)
        win = torch.arange(W, device=dev, dtype=torch.int32).reshape(1, 1, W)
        if name == "CSA":
            picks = torch.randperm(nc, device=dev, generator=gen)[:K].sort().values.to(torch.int32).reshape(1, 1, K)
            idx, nd, nmax = torch.cat([win, picks + W], -1), torch.zeros(1, dtype=torch.long, device=dev), 0
        else:
            idx, nd, nmax = win, torch.full((1,), nc, dtype=torch.long, device=dev), nc
        keys = W + (K if name == "CSA" else nc)

        def torch_attention():
            kk = torch.cat([KW[0], KC[0, idx[0, 0, W:].long() - W] if name == "CSA" else KC[0, :nc]], 0)   # [keys, c]
            z = torch.einsum("hc,sc->hs", q[0, 0], kk) * scale
            mx = z.amax(-1, keepdim=True)
            e = torch.exp(z - mx)
            return torch.einsum("hs,sc->hc", backend_torch.bf16_round(e), kk) / (e.sum(-1, keepdim=True) + torch.exp(sink[:, None] - mx))
        row(f"sparse_attention decode ({name})", f"H={H} c={cw} keys={keys}",
            lambda: kernels_v4.sparse_attention(q, KW, KC, idx, nd, sink, scale, True, n_max=nmax), torch_attention, True,
            flops=4 * H * cw * keys, nbytes=4 * keys * cw)

    # ---- the routed experts' first grouped GEMM (gate | up)
    E, I, top = (256, 2048, 6) if not smoke else (8, 128, 2)
    W13 = torch.randint(0, 256, (E, 2 * I, d // 2), dtype=torch.uint8, device=dev, generator=gen)
    S13 = torch.full((E, 2 * I, d // 32), 2.0 ** -6, device=dev)
    for B in (1, 32, 4096) if not smoke else (1, 4, 64):
        x = randn(B, d)
        idx = torch.stack([torch.randperm(E, device=dev, generator=gen)[:top] for _ in range(B)])
        rows_, _, be = backend_torch.route(idx, E, 16)
        qx, sx = backend_torch.act_quant(x, kern=kernels_cuda)
        used = torch.unique(idx).tolist()
        dense = {e: backend_torch.dequant(quant.Weight(W13[e], S13[e])).to(torch.bfloat16) for e in used}
        tokens = {e: torch.nonzero((idx == e).any(-1)).squeeze(1) for e in used}   # each expert's tokens (fixed here)
        xb = x.to(torch.bfloat16)

        def torch_experts():  # each routed expert's tokens through its bf16 weights (dequantized at load)
            return [xb[tokens[e]] @ dense[e].T for e in used]
        decode = B <= 32
        for kernel in ("gemv", "mma fp16", "mma int8") if decode else ("mma fp16", "mma int8"):
            row(f"fp4_moe_gemm (gate and up), {kernel}", f"{B} token(s) x {top} of {E} experts, {d} -> 2 x {I}",
                lambda: kernels_v4.fp4_moe_gemm(qx, sx, W13, S13, rows_, be, gemv=kernel == "gemv", int8=kernel == "mma int8"),
                torch_experts, decode, flops=2 * B * top * 2 * I * d, nbytes=len(used) * 2 * I * (d // 2 + d // 32 * 4))
        del dense

    bench_gemm.write_kernel_run(a.out, "v4_kernels.json", rows, smoke, render)


if __name__ == "__main__":
    main()
