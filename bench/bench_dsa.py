"""The DSA kernels of kernels_cuda.py against PyTorch baselines run in the same process, on one GPU.

    indexer scores   q [T, 64, 128] FP8, keys [S, 128] FP8 -> [T, S]; counted as 2 * valid pairs * 64 * 128
                     FLOPs (DeepGEMM's count); baseline: bf16 einsum + ReLU + weighted sum over heads
    sparse MLA       decode, 128 heads, top-k 2048 of a context L; counted as 2 * 128 * 2048 * (576 + 512)
    decode           FLOPs per token (FlashMLA's count); baseline: the dense absorbed attention in torch

Shapes follow spec/kernels.md §6. The L2 is flushed before every timed call; selected indices are
random and distinct. `--smoke` runs tiny shapes (on the CPU under TRITON_INTERPRET=1: the timings
mean nothing there, it only checks that the script runs).

    python bench/bench_dsa.py [--out DIR] [--smoke]
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for dsa.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU interpreter)")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import bench_gemm
    import kernels_cuda
    bench_gemm._imports()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)

    def timed(fn):  # median CUDA-event time with the L2 flushed (bench_gemm's); on the CPU one plain call
        if dev == "cuda":
            return bench_gemm.timed(fn, reps=10)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    rows = []
    J, D = (64, 128) if not a.smoke else (16, 128)
    idx_shapes = [(4096, 8192), (4096, 32768), (4096, 65536), (1, 16384), (1, 65536)] if not a.smoke else [(4, 40), (1, 40)]
    for T, S in idx_shapes:                                        # the last T queries of a causal context S
        q = torch.randn(1, T, J, D, device=dev, generator=gen).to(torch.float8_e4m3fn)
        k = torch.randn(1, S, D, device=dev, generator=gen).to(torch.float8_e4m3fn)
        w = torch.randn(1, T, J, device=dev, generator=gen)
        ks = torch.ones(1, S, device=dev)
        t = timed(lambda: kernels_cuda.index_scores(q, w, k, ks, start_pos=S - T))
        qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
        tb = timed(lambda: torch.einsum("btjd,bsd->btjs", qb, kb).relu_().float().mul_(w[..., None]).sum(2))
        pairs = T * S - T * (T - 1) // 2
        rows.append(dict(kernel="indexer scores", shape=f"T={T} S={S}", ms=t, baseline_ms=tb,
                         tflops=2 * pairs * J * D / t / 1e9))
    H, C, R, K = (128, 512, 64, 2048) if not a.smoke else (16, 64, 32, 32)
    for B, L in ([(1, 16384), (1, 65536), (64, 16384), (128, 65536)] if not a.smoke else [(1, 64), (2, 48)]):
        qa = torch.randn(B, H, C, device=dev, generator=gen)
        qp = torch.randn(B, H, R, device=dev, generator=gen)
        kv = torch.randn(B, L, C, device=dev, generator=gen).to(torch.bfloat16)
        pe = torch.randn(B, L, R, device=dev, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(L, device=dev, generator=gen)[:K] for _ in range(B)]).int()
        t = timed(lambda: kernels_cuda.sparse_mla_decode(qa, qp, kv, pe, idx, 0.1))

        def dense():                                                # the dense absorbed attention over all L
            z = (torch.einsum("bhc,blc->bhl", qa.bfloat16(), kv) + torch.einsum("bhr,blr->bhl", qp.bfloat16(), pe)) * 0.1
            return torch.einsum("bhl,blc->bhc", torch.softmax(z.float(), -1).bfloat16(), kv)
        tb = timed(dense)
        rows.append(dict(kernel="sparse MLA decode", shape=f"B={B} L={L} topk={K}", ms=t, baseline_ms=tb,
                         tflops=2 * B * H * K * (C + R + C) / t / 1e9))
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), smoke=a.smoke)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "dsa.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}")
    print("| kernel | shape | us | TFLOP/s | PyTorch baseline us | speed-up |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {1e3 * r['ms']:.1f} | {r['tflops']:.1f} | {1e3 * r['baseline_ms']:.1f} | "
              f"{r['baseline_ms'] / r['ms']:.2f} |")


if __name__ == "__main__":
    main()
