"""Block-FP8 GEMM and act_quant (kernels_fp8.py) on DeepSeek-V3.2-Exp's real shapes, on one GPU.

For each weight shape [N, K] and M in (1, 16, 128, 2048, 4000, 8192; 4000 rows, a prompt's length, are
no whole number of tiles): kernel time (median of CUDA-event
timed replays of the call captured in a CUDA graph, as a captured decode step runs it: GPU time
without Python's launch cost; L2 flushed between runs), TFLOP/s and TB/s, the ratio to the roofline
measured in the same run (FP8 matmul peak via torch._scaled_mm, device copy bandwidth), and the ratio
to torch.matmul in bf16 on the same shape (the named baseline). act_quant is reported in TB/s
against the copy bandwidth.

    python bench/bench_gemm.py [--out DIR]        prints a table; writes DIR/gemm.json and DIR/gemm.md
    python bench/bench_gemm.py --projections      the fp32 projections instead (kernels_fp8.matmul_f32: exact
                                                  products, float64 sums) at 1-64 rows against cuBLAS's fp32
                                                  matmul on a float32 copy of the weight; writes DIR/proj.json
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
torch = kernels_fp8 = None                       # imported in main(): --render needs neither


def _imports():
    global torch, kernels_fp8
    import torch
    import kernels_fp8

SHAPES = {  # name -> (N, K) of the weight, DeepSeek-V3.2-Exp (spec/dsv32.md §2.1)
    "q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512), "o": (7168, 16384),
    "idx_wq_b": (8192, 1536), "idx_wk": (128, 7168), "mlp_w1": (18432, 7168), "mlp_w2": (7168, 18432),
    "expert_w1": (2048, 7168), "expert_w2": (7168, 2048),
    "q_a+kv_a+idx_wk": (2240, 7168), "q_b+idx_wq_b": (32768, 1536),   # the model's fused projections (one GEMM each)
}
MS = (1, 16, 128, 2048, 4000, 8192)
FLUSH = None


def timed(fn, reps=20, graph=True):
    """Median milliseconds over reps CUDA-event-timed replays of fn captured in a CUDA graph (GPU time,
    as a captured decode step runs it, without the Python launch cost), L2 flushed (256 MB write)
    before each. graph=False: fn as given: the rooflines (large enough for the launch not to count;
    a captured 2 GiB device copy measured 2.8 TB/s against 4.2 eagerly), a graph replay the caller
    captured itself, or long eager calls (bench_dsa.py's prefill rows)."""
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    times = []
    for _ in range(reps):
        FLUSH.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def rooflines():
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * n ** 3 / timed(lambda: x @ x, 10, graph=False) / 1e9
    x8 = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8 = 2 * n ** 3 / timed(lambda: torch._scaled_mm(x8, x8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10, graph=False) / 1e9
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copy = 2 * buf.numel() / timed(lambda: dst.copy_(buf), 10, graph=False) / 1e6          # read + write, bytes/ms -> GB/s
    one_kernel = 1e3 * timed(lambda: x[:1, :1].add_(1))   # what any graph-timed call costs here, whatever it does
    return {"bf16_tflops": bf16, "fp8_tflops": fp8, "copy_gbs": copy, "floor_us": one_kernel}


def kernel_bench_cli(doc, json_name, render, more=None):
    """The command line of the kernel benchmarks (bench_dsa.py, bench_v4_kernels.py): --out, --smoke, --render,
    and what more(parser) adds. -> the parsed arguments, or None once --render has printed a stored run's table."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=f"folder for {json_name}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU interpreter)")
    ap.add_argument("--render", help=f"print the table of a stored {json_name}")
    if more is not None:
        more(ap)
    a = ap.parse_args()
    if a.render:
        d = json.loads(Path(a.render).read_text())
        print(render(d["meta"], d["rows"]))
        return None
    import torch as t
    if not t.cuda.is_available():                    # the kernels in the interpreter (--smoke)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _imports()
    return a


def write_kernel_run(out, json_name, rows, smoke, render, **more):  # the run's meta (rooflines, more), JSON, table
    import triton
    cuda = torch.cuda.is_available()
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (interpreter)", torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d"), smoke=smoke,
                roofline=rooflines() if cuda else dict(fp8_tflops=1, bf16_tflops=1, copy_gbs=1), **more)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / json_name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(render(meta, rows))


def floor_note(roof):  # the timing floor, for the tables' headers (stored runs before it was measured: nothing)
    return f"; a graph-timed one-element kernel: {roof['floor_us']:.1f} us" if "floor_us" in roof else ""


def render(meta, rows):  # raw timings -> the markdown table (derived figures computed here)
    roof = meta["roofline"]
    lines = [f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; measured roofline: "
             f"FP8 {roof['fp8_tflops']:.0f} TFLOP/s (torch._scaled_mm 8192^3), bf16 {roof['bf16_tflops']:.0f} TFLOP/s, "
             f"copy {roof['copy_gbs']:.0f} GB/s{floor_note(roof)}", "",
             "| shape | M | N x K | FP8 GEMM us | TFLOP/s | TB/s | of roofline | bf16 matmul us | speed-up vs bf16 "
             "| act_quant us | act_quant TB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        M, N, K, t = r["M"], r["N"], r["K"], r["ms"]
        flops = 2 * M * N * K
        nbytes = M * K + N * K + 4 * (M + -(-N // 128)) * (K // 128) + 2 * M * N   # fp8 in, scales, bf16 out
        t_roof = max(flops / (roof["fp8_tflops"] * 1e9), nbytes / (roof["copy_gbs"] * 1e6))   # ms
        aq_bytes = 2 * M * K + M * K + 4 * M * K // 128                            # bf16 in, fp8 + scales out
        lines.append(f"| {r['shape']} | {M} | {N}x{K} | {1e3 * t:.1f} | {flops / t / 1e9:.0f} | {nbytes / t / 1e9:.2f} | "
                     f"{t_roof / t:.2f} | {1e3 * r['bf16_ms']:.1f} | {r['bf16_ms'] / t:.2f} | "
                     f"{1e3 * r['act_quant_ms']:.1f} | {aq_bytes / r['act_quant_ms'] / 1e9:.2f} |")
    return lines


PROJECTIONS = {"router": (256, 7168), "indexer head weights": (64, 7168), "output head": (129280, 7168)}  # W [N, K]
PROJ_ROWS = (1, 4, 8, 32, 64)


def render_projections(meta, rows):
    lines = [f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; bf16 weights, rows of "
             "bf16 values, graph-replayed, L2 flushed", "",
             "| weight [N, K] | rows | matmul_f32 us | weight TB/s | cuBLAS fp32 us | matmul_f32 / cuBLAS | "
             "= float64 product rounded once |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weight']} [{r['N']}, {r['K']}] | {r['M']} | {1e3 * r['ms']:.1f} | "
                     f"{2 * r['N'] * r['K'] / r['ms'] / 1e9:.2f} | {1e3 * r['cublas_ms']:.1f} | "
                     f"{r['ms'] / r['cublas_ms']:.2f} | {'yes' if r['exact'] else 'NO'} |")
    return lines


def projections(out):  # --projections: matmul_f32 on the fp32 projections' shapes
    import triton
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K) in PROJECTIONS.items():
        W = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        Wf = W.float()
        for M in PROJ_ROWS:
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16).float()
            exact = torch.equal(kernels_fp8.matmul_f32(x, W.T), (x.double() @ W.double().T).float())
            rows.append(dict(weight=name, N=N, K=K, M=M, exact=exact, ms=timed(lambda: kernels_fp8.matmul_f32(x, W.T)),
                             cublas_ms=timed(lambda: x @ Wf.T)))
            print(render_projections(dict(gpu="", date="", torch="", triton=""), rows[-1:])[-1], flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "proj.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\n".join(render_projections(meta, rows)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gemm.json and gemm.md")
    ap.add_argument("--render", default=None, help="re-render the table of an earlier gemm.json or proj.json "
                    "(no GPU needed)")
    ap.add_argument("--projections", action="store_true", help="the fp32 projections (matmul_f32) instead")
    a = ap.parse_args()
    if a.render:
        d = json.loads(Path(a.render).read_text())
        print("\n".join((render_projections if "cublas_ms" in d["rows"][0] else render)(d["meta"], d["rows"])))
        return
    _imports()
    if a.projections:
        return projections(a.out)
    torch.manual_seed(0)
    roof = rooflines()
    rows = []
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        sw = torch.rand(-(-N // 128), K // 128, device="cuda") + 0.5
        wb = (torch.randn(K, N, device="cuda") * 0.05).to(torch.bfloat16)
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            q, s = kernels_fp8.act_quant(x)
            t = timed(lambda: kernels_fp8.fp8_gemm(q, s, w, sw))
            tb = timed(lambda: x @ wb)
            ta = timed(lambda: kernels_fp8.act_quant(x))
            rows.append(dict(shape=name, M=M, N=N, K=K, ms=t, bf16_ms=tb, act_quant_ms=ta))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, date=time.strftime("%Y-%m-%d"), roofline=roof)
    (Path(a.out) / "gemm.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = render(meta, rows)
    (Path(a.out) / "gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
