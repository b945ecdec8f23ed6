"""Tensor and expert parallelism (parallel.py) on the CPU with the gloo backend: 2 and 4 processes
launched by torch.distributed.run equal one process (exact numerics: logits within 1e-5, the same
greedy tokens); layouts that cannot be split are refused."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import checkpoint
import ops
import parallel
from config import ModelArgs
from conftest import gpu
from helpers import rel_err
from model import Transformer, load_layer

pytestmark = pytest.mark.slow      # several processes (gloo ranks, torchrun): not in the fast loop (-m "not slow")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 8 heads, 8 experts, vocabulary 2048, MLP and expert widths of 512: every slice of 2 or 4 ranks
    # covers whole 128x128 scale blocks (wq_b 2 x 128 rows, wkv_b 2 x 128, wo 2 x 64 columns per rank at 4)
    cfg = checkpoint.tiny_config(num_attention_heads=8, intermediate_size=512, moe_intermediate_size=512, index_topk=8)
    path = tmp_path_factory.mktemp("par") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights(cfg, 5))


@pytest.fixture(scope="module")
def ckpt_v4(tmp_path_factory):
    # tiny V4 with a shared expert of 256 (128 columns a rank at 2: whole scale blocks); 4 heads in 2 output
    # groups, 8 routed experts: 2 ranks take 2 heads, 1 group and 4 experts each. index_topk 2 against the
    # CSA layers' up to 6 complete windows of the script's 26 positions: the picks are a choice
    cfg = checkpoint.tiny_config_v4(moe_intermediate_size=256, index_topk=2, vocab_size=2048)
    path = tmp_path_factory.mktemp("parv4") / "ckpt"
    return checkpoint.write_checkpoint(path, cfg, checkpoint.random_weights_v4(cfg, 5))


def single(ckpt, numerics="exact", attention="sparse", device="cpu"):
    from parallel_worker import script
    return script(Transformer.from_pretrained(ckpt, backend="torch", device=device, numerics=numerics, attention=attention))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ckpt, n, out, numerics="exact", attention="sparse", what="script", device="cpu"):
    # ranks on the CPU (gloo) unless device="cuda": the CPU comparisons run on a GPU machine too
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(free_port()),
           str(ROOT / "tests" / "parallel_worker.py"), str(ckpt), str(out), numerics, attention, what, device]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_model_equals_one_process(ckpt, n, tmp_path):
    want = single(ckpt)
    got = launch(ckpt, n, tmp_path / "out.npz")
    for k in ("prefill", "chunk", "steps"):
        assert got[k].shape == want[k].shape, k
        assert rel_err(got[k], want[k]) <= 1e-5, k
    np.testing.assert_array_equal(got["steps"].argmax(-1), want["steps"].argmax(-1))        # same greedy tokens


@gpu
@pytest.mark.parametrize("model", ["v32", "v4"])
def test_parallel_on_two_gpus_with_nccl_equals_one_gpu(ckpt, ckpt_v4, model, tmp_path):
    # the same comparison on two GPUs (NCCL; the kernels on each): run on a machine with two H200s
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = ckpt if model == "v32" else ckpt_v4
    want = single(path, device="cuda")
    got = launch(path, 2, tmp_path / "nccl.npz", device="cuda")
    for k in ("prefill", "chunk", "steps"):
        assert rel_err(got[k], want[k]) <= 1e-5, k
    np.testing.assert_array_equal(got["steps"].argmax(-1), want["steps"].argmax(-1))


@gpu
@pytest.mark.parametrize("model", ["v32", "v4"])
def test_parallel_decode_replayed_from_a_cuda_graph_on_two_gpus(ckpt, ckpt_v4, model, tmp_path):
    # official numerics, NCCL collectives captured in the graph: the replayed steps equal the plain ones
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    path = ckpt if model == "v32" else ckpt_v4
    got = launch(path, 2, tmp_path / "graph.npz", numerics="official", what="graph", device="cuda")
    assert np.isfinite(got["plain"]).all()
    err = rel_err(got["graph"], got["plain"])                     # the same kernels, attention over the capacity
    assert err <= 1e-3, err
    np.testing.assert_array_equal(got["graph"].argmax(-1), got["plain"].argmax(-1))


def test_v4_parallel_model_equals_one_process(ckpt_v4, tmp_path):
    # DeepSeek-V4: heads, output groups, routed experts and the shared expert split over 2 ranks (gloo);
    # prefill, a chunk after the cache and greedy decode against one process, exact numerics
    want = single(ckpt_v4)
    got = launch(ckpt_v4, 2, tmp_path / "v4.npz")
    for k in ("prefill", "chunk", "steps"):
        assert got[k].shape == want[k].shape, k
        assert rel_err(got[k], want[k]) <= 1e-5, k
    np.testing.assert_array_equal(got["steps"].argmax(-1), want["steps"].argmax(-1))
    # official numerics run (the parts are rounded to bf16 before their sum, and this random model is chaotic
    # end to end, as tests/test_v4.py notes: closeness is checked sublayer by sublayer, below)
    off = launch(ckpt_v4, 2, tmp_path / "v4off.npz", numerics="official")
    assert np.isfinite(off["steps"]).all() and off["steps"].shape == want["steps"].shape


def test_v4_parallel_official_sublayers_within_bf16_of_one_process(ckpt_v4, tmp_path):
    # official numerics, every layer's attention and MoE on one fixed input: 2 ranks' parts are each rounded to
    # bf16 before their sum (the official code's order), so the two agree to a few bf16 ulps of the parts
    from parallel_worker import v4_sublayers
    want = v4_sublayers(Transformer.from_pretrained(ckpt_v4, backend="torch", device="cpu"))
    got = launch(ckpt_v4, 2, tmp_path / "v4sub.npz", numerics="official", what="v4_sublayers")
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 2 ** -6 * np.abs(want[k]).max(), k


def test_v4_layouts_that_cannot_be_split_are_refused(ckpt_v4):
    import model_v4
    from config import V4Args
    ck = checkpoint.Checkpoint(ckpt_v4)
    args = V4Args.from_config(ck.config)
    weights = {"layers": [model_v4.load_layer(ck, i, args) for i in range(args.num_hidden_layers)]}
    with pytest.raises(parallel.ShardError, match=r"o_groups \(2\) is not divisible by the number of ranks \(4\)"):
        parallel.Parallel(0, 4).shard_v4(weights, args)
    with pytest.raises(parallel.ShardError, match=r"num_attention_heads \(4\) is not divisible by the number of ranks \(3\)"):
        parallel.Parallel(0, 3).shard_v4(weights, args)
    w, a = parallel.Parallel(1, 2).shard_v4(weights, args)
    assert (a.num_attention_heads, a.o_groups) == (2, 1) and w["layers"][2]["ffn"]["expert_range"] == (4, 8)
    assert w["layers"][2]["attn"]["wq_b"].w.shape[0] == 2 * args.head_dim
    assert isinstance(w["layers"][0]["attn"]["wo_b"], parallel.RowShard)
    np.testing.assert_array_equal(w["layers"][0]["attn"]["attn_sink"], weights["layers"][0]["attn"]["attn_sink"][2:])


def test_parallel_dense_attention_and_official_numerics_run(ckpt, tmp_path):
    want = single(ckpt, attention="dense")
    got = launch(ckpt, 2, tmp_path / "dense.npz", attention="dense")
    assert rel_err(got["prefill"], want["prefill"]) <= 1e-5
    off = launch(ckpt, 2, tmp_path / "official.npz", numerics="official")
    assert np.isfinite(off["steps"]).all()


def test_expert_parallel_grouped_moe_equals_one_process(ckpt, tmp_path):
    # official numerics: each rank's experts through the grouped FP8 GEMM (pairs routed elsewhere to a
    # skipped virtual expert), summed over ranks; against one process's MoE op on the same input. The
    # shared expert's w2 partials are rounded to bf16 before their sum (as the official code does), so
    # the two agree to bf16 rounding, not bit for bit.
    from parallel_worker import moe_op
    want = moe_op(Transformer.from_pretrained(ckpt, backend="torch", device="cpu"))["moe"]
    got = launch(ckpt, 4, tmp_path / "moe.npz", numerics="official", what="moe")["moe"]
    assert rel_err(got, want) <= 1e-2


def test_layouts_that_cannot_be_split_are_refused(ckpt, tmp_path):
    import model
    ck = checkpoint.Checkpoint(ckpt)
    args = ModelArgs.from_config(ck.config)
    weights = {"embed": ck.get("model.embed_tokens.weight"), "head": ck.get("lm_head.weight"),
               "layers": [load_layer(ck, i, args) for i in range(args.num_hidden_layers)]}
    with pytest.raises(parallel.ShardError, match=r"num_attention_heads \(8\) is not divisible by the number of ranks \(3\)"):
        parallel.Parallel(0, 3).shard(weights, args)
    with pytest.raises(parallel.ShardError, match="cut a 128x128 FP8 scale block"):
        parallel.Parallel(1, 8).shard(weights, args)                  # 1 head per rank: wo slices of 64 columns
    w, a = parallel.Parallel(1, 2).shard(weights, args)
    assert a.num_attention_heads == 4 and w["embed"].shape[0] == 1024
    assert len(w["layers"][1]["ffn"]["experts"]) == 4 and w["layers"][1]["ffn"]["expert_range"] == (4, 8)
    assert isinstance(w["layers"][0]["attn"]["wo"], parallel.RowShard)
    with pytest.raises(parallel.ShardError, match="backend='torch'"):
        parallel.Parallel(0, 2).wrap(ops.NUMPY_OPS)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    # the same split-friendly shapes with the real vocabulary and the bundled tokenizer (tiny-v32)
    import shutil
    tiny = ROOT / "tiny-v32"
    if not (tiny / "tokenizer.json").is_file():
        pytest.skip("needs the bundled tiny-v32 (./setup.sh builds it) for its tokenizer")
    cfg = checkpoint.tiny_config(num_attention_heads=8, intermediate_size=512, moe_intermediate_size=512,
                                 index_topk=8, vocab_size=129280)
    path = checkpoint.write_checkpoint(tmp_path_factory.mktemp("parchat") / "ckpt", cfg, checkpoint.random_weights(cfg, 6))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, path / f)
    return path


def test_torchrun_generate_equals_one_process(chat_ckpt):
    # `torchrun --nproc-per-node 2 generate.py ...` prints what one process prints; interactive input
    # is read by rank 0 and broadcast (two turns, then EOF)
    import os
    common = ["--ckpt", str(chat_ckpt), "--backend", "torch", "--device", "cpu", "--numerics", "exact",
              "--temperature", "0", "--max-new-tokens", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda pre, extra, **kw: subprocess.run(pre + [str(ROOT / "generate.py")] + common + extra,    # noqa: E731
                                                  capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kw)
    tr = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    one, par = run([sys.executable], ["--prompt", "Hello there"]), run(tr, ["--prompt", "Hello there"])
    assert one.returncode == 0 and par.returncode == 0, par.stderr[-2000:]
    assert par.stdout == one.stdout and par.stdout.strip()
    chat_in = "Hi\nAnd again\n"
    one = run([sys.executable], ["--interactive"], input=chat_in)
    tr[-1] = str(free_port())
    par = run(tr, ["--interactive"], input=chat_in)
    assert one.returncode == 0 and par.returncode == 0, par.stderr[-2000:]
    assert par.stdout == one.stdout and par.stdout.count(">>> ") == 3


@pytest.mark.parametrize("model", ["v32", "v4"])
def test_parallel_benchmark_script_runs(ckpt, ckpt_v4, model, tmp_path):
    # bench/bench_parallel.py on the CPU: 1 and 2 gloo ranks, tiny shapes; then its table and estimate
    import os
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    path = ckpt if model == "v32" else ckpt_v4
    bench = [str(ROOT / "bench" / "bench_parallel.py"), "--ckpt", str(path), "--out", str(tmp_path), "--prefill", "16",
             "--steps", "2", "--batch", "2", "--batch-prefill", "8", "--device", "cpu"]
    for pre in ([sys.executable], [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--master-port", str(free_port())]):
        r = subprocess.run(pre + bench, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_parallel.py"), "--render",
                        str(tmp_path / "parallel_1.json"), str(tmp_path / "parallel_2.json")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    layers = 61 if model == "v32" else 43                          # the whole model's, from the runs' meta
    assert r.returncode == 0 and "| 2 |" in r.stdout and f"Estimate (not measured) for 8 ranks and {layers} layers" in r.stdout


def test_eight_rank_estimate_fit():
    # bench_parallel.fit8 on times made from t(r) = a + b/r, plus collectives c on 2 ranks: the 8-rank
    # estimate is a + b/8 + (7/4) c, the ring all-reduce's 2(n-1)/n growth from 2 to 8 ranks
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_parallel import fit8
    a, b, c = 0.3e-3, 2.0e-3, 0.05e-3
    assert abs(fit8(a + b, a + b / 2) - (a + b / 8)) <= 1e-12
    assert abs(fit8(a + b, a + b / 2 + c) - (a + b / 8 + 1.75 * c)) <= 1e-12


def test_more_ranks_than_gpus_is_refused_with_a_message(monkeypatch):
    # torchrun --nproc-per-node 4 on a host with one GPU: one line saying what to do, before any GPU
    # is touched (it died on "CUDA error: invalid device ordinal"); --device cpu runs the ranks on gloo
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("touched a GPU"))
    with pytest.raises(parallel.ShardError, match=r"started 4 ranks on this host but it has 1 GPU\(s\): use "
                                                  r"--nproc-per-node 1 or fewer, or run the ranks on the CPU with --device cpu"):
        parallel.init_from_env()
    with pytest.raises(parallel.ShardError, match="--device tpu"):
        parallel.init_from_env("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(parallel.ShardError, match="no GPU is visible"):
        parallel.init_from_env("cuda")
