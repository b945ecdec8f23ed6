"""generate.py end to end on the bundled tiny checkpoint (real tokenizer, chat format), the loop's
properties on the fixture model, and clear errors on bad input."""
import codecs
import dataclasses
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import checkpoint
import generate
from conftest import FIXTURE_CKPT, ROOT, gpu
from model import Transformer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return checkpoint.build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-v32")


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_cli_generates_and_reports_speed(tiny):
    r = run("--ckpt", tiny, "--prompt", "Hello, who are you?", "--max-new-tokens", 24, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert "numerics=official attention=sparse indexer=fp8" in r.stderr and "yarn=on" in r.stderr
    assert "prefill:" in r.stderr and "decode:" in r.stderr and "tok/s" in r.stderr
    assert len(r.stdout.strip()) > 0
    raw = run("--ckpt", tiny, "--prompt", "Hello", "--raw", "--max-new-tokens", 4, "--temperature", 0)
    assert raw.returncode == 0 and "prefill: 1 tokens" in raw.stderr   # "Hello" alone, no chat format
    again = run("--ckpt", tiny, "--prompt", "Hello, who are you?", "--max-new-tokens", 24, "--temperature", 0)
    assert again.stdout == r.stdout                                     # greedy is deterministic


@pytest.mark.slow
def test_cli_batch_file_and_sampling(tiny, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("First prompt, short.\n\nA second prompt that is a good deal longer than the first one.\n")
    r = run("--ckpt", tiny, "--input-file", f, "--max-new-tokens", 8, "--temperature", 0.8, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Prompt: ") == 2 and r.stdout.count("Completion: ") == 2


@pytest.mark.slow
def test_cli_interactive_reuses_the_cache(tiny):
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny), "--interactive",
                        "--max-new-tokens", "6", "--temperature", "0"],
                       input="hi\nand again\n/exit\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "chat: type a message; /help lists the commands, /exit or Ctrl-D quits\n" in r.stderr   # the hint
    import re
    first, second = map(int, re.findall(r"prefill: (\d+) tokens", r.stderr))
    # turn 2 renders the whole conversation (turn 1's prompt, its 6 answer tokens, EOS, the new user
    # turn), but only what the caches lack is prefilled
    assert second < first + 6


@pytest.mark.slow
def test_cli_errors_are_clear(tiny, tmp_path):
    r = run("--ckpt", tmp_path / "missing", "--prompt", "x")
    assert r.returncode != 0 and "no such folder" in r.stderr
    r = run("--ckpt", FIXTURE_CKPT, "--prompt", "x")
    assert r.returncode != 0 and "tokenizer.json is missing" in r.stderr
    r = run("--ckpt", tiny, "--prompt", "x", "--max-seq-len", 20, "--max-new-tokens", 50)
    assert r.returncode != 0 and "exceeds max_seq_len 20" in r.stderr
    r = run("--ckpt", tiny, "--input-file", tmp_path / "none.txt")
    assert r.returncode != 0 and "no such file" in r.stderr


def test_batch_equals_one_by_one_with_teacher_forcing():
    # exact numerics: the longer prompt is teacher-forced through decode steps in the batch but
    # prefilled at once alone, and only in exact numerics do the two attention modes agree
    m = Transformer.from_pretrained(FIXTURE_CKPT, numerics="exact")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]                  # different lengths
    batch, stats = generate.generate(m, prompts, 10, eos_id=-1, temperature=0)
    assert stats["prefill_tokens"] == 2 * 3 and stats["decode_tokens"] > 0
    for p, c in zip(prompts, batch):
        alone, _ = generate.generate(m, [p], 10, eos_id=-1, temperature=0)
        assert alone[0] == c and len(c) == 10


def test_eos_stops_and_is_cut():
    m = Transformer.from_pretrained(FIXTURE_CKPT)
    free, _ = generate.generate(m, [[1, 2, 3]], 12, eos_id=-1, temperature=0)
    eos = free[0][4]                                                    # pretend the 5th token is EOS
    cut, _ = generate.generate(m, [[1, 2, 3]], 12, eos_id=eos, temperature=0)
    assert cut[0] == free[0][:free[0].index(eos)]


def test_sampling_is_an_exact_categorical_draw():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    draws = np.array([generate.sample(logits, 1.0, rng)[0] for _ in range(6000)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)
    assert generate.sample(logits, 0, rng)[0] == 0


class ScriptedModel:
    """Stands in for the Transformer: each forward call 'predicts' the next token of a script, so the
    chat wiring (tool calls, results, cache reuse) can be checked without a trained model."""
    can_rewind = True

    def __init__(self, script, vocab=129280):
        from types import SimpleNamespace
        self.script, self.vocab, self.calls = list(script), vocab, []
        self.args = SimpleNamespace(max_seq_len=4096)

    def reserve(self, batch, total_len):
        pass

    def forward(self, tokens, start_pos=0):
        tokens = np.asarray(tokens)
        self.calls.append((start_pos, tokens.shape[1]))
        logits = np.zeros((tokens.shape[0], self.vocab), np.float32)
        logits[:, self.script.pop(0) if self.script else 1] = 1
        return logits


def test_interactive_tool_round_trip(tiny):
    from types import SimpleNamespace
    import chat
    tok = generate.load_tokenizer(tiny)
    call = (chat.CALLS_BEGIN + chat.CALL_BEGIN + "get_time" + chat.TOOL_SEP + '{"city": "東京"}' + chat.CALL_END
            + chat.CALLS_END)
    script = tok.encode(call, add_special_tokens=False).ids + [1] + tok.encode("It is 10:00.", add_special_tokens=False).ids + [1]
    model = ScriptedModel(script)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    a = SimpleNamespace(chat_format="v32exp", thinking=False, tool_list=tools, max_new_tokens=40, temperature=0)
    answers = iter(["What time is it in Tokyo?", "10:00", "/exit"])
    asked = []

    def read(prompt):
        asked.append(prompt)
        return next(answers)

    import io
    out = io.StringIO()
    generate.interactive(model, tok, a, np.random.default_rng(0), 1, read=read, out=out)
    text = out.getvalue()
    assert '[tool call] {"name": "get_time", "arguments": {"city": "東京"}}' in text
    assert "It is 10:00." in text
    assert asked == [">>> ", "result of get_time> ", ">>> "]
    # the second model turn prefilled only the tool result: it started from the cached conversation
    second_turn_start = [s for s, n in model.calls if n > 1][1]
    assert second_turn_start > 100


@pytest.mark.slow
def test_cli_thinking_tools_and_formats(tiny, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "get_time", "parameters": {}}}]')
    r = run("--ckpt", tiny, "--prompt", "hi", "--thinking", "--tools", tools, "--max-new-tokens", 4, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[reasoning] ")                     # the prompt ends with <think>
    assert "chat_format=v32exp thinking=True tools=1" in r.stderr
    r = run("--ckpt", tiny, "--prompt", "hi", "--chat-format", "dsml32", "--max-new-tokens", 4, "--temperature", 0)
    assert r.returncode == 0 and "chat_format=dsml32" in r.stderr
    tools.write_text("{not json")
    r = run("--ckpt", tiny, "--prompt", "hi", "--tools", tools)
    assert r.returncode != 0 and "not valid JSON" in r.stderr
    tools.write_text('{"name": "x"}')
    r = run("--ckpt", tiny, "--prompt", "hi", "--tools", tools)
    assert r.returncode != 0 and "expected a JSON list" in r.stderr


# -----------------------------------------------------------------------------
# Bad input: one line "error: ..." naming the flag or file, exit status 2, no traceback (--debug: one)

def main_fails(capsys, *args):  # generate.main as the CLI runs it -> (exit status, stderr's lines)
    with pytest.raises(SystemExit) as e:
        generate.main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0 (0 is greedy)"),
    (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0 (0 is greedy)"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number >= 0 (0 is greedy)"),
    (["--seed", "-1"], "--seed -1: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    (["--max-seq-len", "0"], "--max-seq-len 0: must be positive"),
    (["--backend", "torch", "--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
    (["--device", "cuda"], "--device cuda needs --backend torch (the NumPy reference runs on the CPU)"),
    (["--backend", "torch", "--device", "cuda:99"], "--device cuda:99: "),     # no GPU, or fewer than 100
])
def test_cli_bad_flags(tiny, capsys, flags, message):
    code, err = main_fails(capsys, "--ckpt", tiny, "--prompt", "x", *flags)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + message), err


@pytest.mark.slow
def test_cli_bad_input_is_one_line_without_traceback(tiny):
    r = run("--ckpt", tiny, "--prompt", "x", "--temperature", "nan")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "error: --temperature nan: must be a finite number >= 0 (0 is greedy)\n"
    r = run("--ckpt", tiny, "--prompt", "x", "--temperature", "nan", "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: --temperature nan" in r.stderr
    assert "0 done; 2 bad input" in run("--help").stdout


def broken_copy(tiny, tmp_path, **files):  # the tiny checkpoint by links, with some files replaced
    out = tmp_path / "broken"
    out.mkdir()
    for f in tiny.iterdir():
        (out / f.name).symlink_to(f)
    for name, text in files.items():
        (out / name).unlink()
        (out / name).write_text(text)
    return out


@pytest.mark.parametrize("name, text, message", [
    ("tokenizer.json", "garbage{", "tokenizer.json: not a tokenizer the tokenizers library can read (expected value"),
    ("tokenizer.json", '{"model": 3}', "tokenizer.json: not a tokenizer the tokenizers library can read"),
    ("tokenizer_config.json", "[]", "tokenizer_config.json: expected a JSON object"),
    ("tokenizer_config.json", "{", "tokenizer_config.json: not valid JSON"),
    ("config.json", "[]", "config.json: expected a JSON object, got an array"),
])
def test_cli_broken_checkpoint_files(tiny, tmp_path, capsys, name, text, message):
    ck = broken_copy(tiny, tmp_path, **{name: text})
    code, err = main_fails(capsys, "--ckpt", ck, "--prompt", "x")
    assert code == 2 and err[-1].startswith(f"error: {ck}/{message}"), err


def test_cli_config_field_of_the_wrong_type(tiny, tmp_path, capsys):
    import json
    cfg = json.loads((tiny / "config.json").read_text())
    ck = broken_copy(tiny, tmp_path, **{"config.json": json.dumps(cfg | {"rope_theta": "10000"})})
    code, err = main_fails(capsys, "--ckpt", ck, "--prompt", "x")
    assert code == 2 and err[-1] == f"error: {ck}/config.json: rope_theta must be a finite number, got a string '10000'"


@pytest.mark.parametrize("tools, message", [
    ('[{"type": "function", "function": "get_time"}]', 'tool 0: "function" must be an object, got a string'),
    ('[{"type": "function", "function": {"name": 3}}]', "tool 0: name must be a non-empty string, got an integer"),
    ('[{"name": "f"}, {"name": "g", "parameters": []}]',
     "tool 1 (g): parameters must be an object (a JSON schema), got an array"),
    ('[{"name": "f", "description": 1}]', "tool 0 (f): description must be a string, got an integer"),
    ('[{"type": "retrieval", "function": {"name": "f"}}]', "tool 0: type 'retrieval' is not \"function\""),
    ("[3]", "tool 0: expected an object, got an integer"),
    ('{"name": "x"}', ": expected a JSON list of tools, each with a function name; got an object"),
    ("[" * 100_000, ": JSON nested too deeply to read"),
])
def test_cli_bad_tool_lists(tiny, tmp_path, capsys, tools, message):
    f = tmp_path / "tools.json"
    f.write_text(tools)
    code, err = main_fails(capsys, "--ckpt", tiny, "--prompt", "x", "--tools", f)
    assert code == 2 and err == [f"error: --tools {f}" + ("" if message[0] == ":" else ": ") + message], err


def test_cli_input_file_that_is_not_text(tiny, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"caf\xe9\n")
    code, err = main_fails(capsys, "--ckpt", tiny, "--input-file", f)
    assert code == 2 and err[-1] == f"error: --input-file {f}: not UTF-8 text (invalid continuation byte at byte 3)"


def test_tool_lists_in_both_shapes_load(tmp_path):
    f = tmp_path / "tools.json"
    f.write_text('[{"type": "function", "function": {"name": "a", "description": null, "parameters": {}}},'
                 ' {"name": "b", "description": "bare"}]')
    assert [t.get("function", t)["name"] for t in generate.load_tools(f)] == ["a", "b"]


def test_generate_rejects_a_temperature_that_is_not_a_number():
    with pytest.raises(ValueError, match="temperature nan: must be a finite number"):
        generate.generate(ScriptedModel([5]), [[1, 2]], 3, eos_id=1, temperature=float("nan"))
    out, _ = generate.generate(ScriptedModel([5]), [[1, 2]], 3, eos_id=-1, temperature=np.float32(0.5))   # NumPy too
    assert len(out[0]) == 3


def test_ctrl_c_while_loading_exits_130(tiny, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate.Transformer, "from_pretrained", interrupted)
    code, err = main_fails(capsys, "--ckpt", tiny, "--prompt", "x")
    assert code == 130 and err[-1] == "interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["generating", "at the chat prompt"])
def test_ctrl_c_exits_130_without_traceback(tiny, where):
    import signal
    flags = ["--prompt", "x", "--max-new-tokens", "900"] if where == "generating" else ["--interactive"]
    p = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny), "--temperature", "0", *flags],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # (SIGINT as a terminal delivers it, even where the suite runs in the background: a shell starts background
    # jobs with SIGINT ignored, and a child inherits that)
    err = []
    while not (err and err[-1].startswith("ckpt=")):                    # the settings line: loaded, starting
        err.append(p.stderr.readline())
        assert err[-1], err
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    if where == "at the chat prompt":                                   # the first one asks, a second in a row quits
        time.sleep(1)
        p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in rest and rest.strip().splitlines()[-1] == "interrupted", rest


def test_benchmark_tables_render_from_the_stored_runs():
    # the stored H200 runs re-render into bench/RESULTS.md's table without a GPU
    import json
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_gemm
    d = json.loads((ROOT / "bench" / "gemm_h200_2026-12-03_2.json").read_text())   # (earlier runs beside it)
    lines = bench_gemm.render(d["meta"], d["rows"])
    assert len(lines) == 4 + len(d["rows"]) and "NVIDIA H200" in lines[0]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert all(line in results for line in lines[2:])
    d = json.loads((ROOT / "bench" / "proj_h200_2026-12-03.json").read_text())      # --projections
    lines = bench_gemm.render_projections(d["meta"], d["rows"])
    assert len(lines) == 4 + 15 and all(line in results for line in lines)
    import bench_pdl
    d = json.loads((ROOT / "bench" / "pdl_h200_2026-12-03.json").read_text())
    lines = bench_pdl.render(d["meta"], d["res"])
    assert len(lines) == 4 + 7 + 1 and all(line in results for line in lines)


def test_dsa_and_figure3_tables_render_from_the_stored_runs():
    import json
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_dsa
    import bench_fig3
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    for part in (1, 2):                                  # one run with TileLang beside ours, in two calls (--only)
        d = json.loads((ROOT / "bench" / f"dsa_h200_2026-12-02_{part}.json").read_text())
        table = bench_dsa.render(d["meta"], d["rows"]).splitlines()
        assert "NVIDIA H200" in table[0] and "TileLang 0.1.15" in table[0] and len(table) == 4 + len(d["rows"])
        assert all(line in results for line in table)
    for day in ("2026-11-30", "2026-12-03"):
        f = json.loads((ROOT / "bench" / f"fig3_h200_{day}.json").read_text())
        assert all(line in results for line in bench_fig3.render(f).splitlines()[2:])
        assert (ROOT / "bench" / f"fig3_h200_{day}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_v4_cost_curve_renders_from_the_stored_run():
    # bench/RESULTS.md's V4 table and figures are the stored run's, and its claims' ratios are the JSON's
    import json
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_v4
    d = json.loads((ROOT / "bench" / "v4_h200_2026-12-02.json").read_text())
    lines = bench_v4.render(d).splitlines()
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert "NVIDIA H200" in lines[0] and all(line in results for line in lines[2:])
    assert d["kv_bytes_per_token"] == bench_v4.kv_bytes() and d["flops_1m"] == bench_v4.flops_per_token(1 << 20)
    assert "7.3%" in results and "12.1%" in results
    assert (ROOT / "bench" / "v4_h200_2026-12-02.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_v4_kernels_benchmark_script_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_v4_kernels.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    kernels = {line.split(" | ")[0].lstrip("| ") for line in r.stdout.splitlines()[4:]}
    assert {"mHC pair (hc_mix_pre + hc_post)", "compress_keys (CSA, m=4)", "compress_keys (HCA, m=16)", "index_scores_v4",
            "top-k (kernels_cuda.topk_indices)", "sparse_attention decode (CSA)", "fp4_moe_gemm (gate and up), gemv",
            "fp4_moe_gemm (gate and up), mma fp16", "fp4_moe_gemm (gate and up), mma int8"} <= kernels, kernels
    assert (tmp_path / "v4_kernels.json").is_file()


@pytest.mark.slow
def test_dsa_benchmark_script_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_dsa.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "| sparse MLA decode (fp8 cache) |" in r.stdout and "| sparse MLA prefill (bf16 cache) |" in r.stdout and (tmp_path / "dsa.json").is_file()


FAKE_TILELANG = {  # TileLang's example interfaces as the anchors use them, computed in torch: the harness's plumbing
    "fp8_lighting_indexer": """
import torch
def mqa_attn_return_logits_interface(q, kv, kv_scales, weights, cu_seqlen_ks, cu_seqlen_ke):
    s = (torch.einsum("tjd,sd->tjs", q.float(), kv.float()).relu() * weights[:, :, None]).sum(1) * kv_scales
    pos = torch.arange(kv.shape[0], device=kv.device)
    seen = (pos[None] >= cu_seqlen_ks[:, None]) & (pos[None] < cu_seqlen_ke[:, None])
    return s.masked_fill(~seen, float("-inf"))
""",
    "topk_selector": """
import torch
def tl_topk(s, starts, ends, k):
    pos = torch.arange(s.shape[1], device=s.device)
    inside = (pos[None] >= starts[:, None]) & (pos[None] < ends[:, None])
    return torch.topk(s.masked_fill(~inside, float("-inf")), k, dim=-1).indices.int()
""",
    "sparse_mla_fwd_pipelined": """
import torch
def sparse_mla_fwd_interface(q, kv, indices, q_start_index_s, kv_stride, sm_scale=None, return_kernel=False):
    C = 512 if q.shape[-1] > 512 else q.shape[-1] - 64
    def kernel(q, kv, indices, q0):
        B, T, H, _ = q.shape
        L = kv.shape[1]
        idx = indices[:, :, 0].long()                                       # [B, T, K], L: padding
        t = torch.arange(T, device=q.device)[None, :, None]
        ok = (idx < L) & (idx <= int(q0[0]) + t)
        rows = kv[:, :, 0][torch.arange(B)[:, None, None], idx.clamp(max=L - 1)].float()   # [B, T, K, C + R]
        z = torch.einsum("bthd,btkd->bthk", q.float(), rows) * sm_scale
        p = torch.softmax(z.masked_fill(~ok[:, :, None], float("-inf")), -1)
        return torch.einsum("bthk,btkc->bthc", p, rows[..., :C]).to(q.dtype), None
    return kernel
""",
}


@pytest.mark.slow
def test_dsa_benchmark_runs_tilelang_beside_ours(tmp_path):
    # --tilelang DIR: TileLang's example modules imported from DIR (here stand-ins in torch with their interfaces)
    # and run on the same inputs in their conventions; the rows say whether the two agree
    tl = tmp_path / "tl"
    tl.mkdir()
    for name, src in FAKE_TILELANG.items():
        (tl / f"{name}.py").write_text(src)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_dsa.py"), "--smoke", "--out", str(tmp_path),
                        "--tilelang", str(tl), "--only", "indexer-prefill,top-k,mla-prefill"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "| TileLang us | speed vs TileLang | agree |" in lines[2]
    agree = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[-2] for line in lines[4:]}
    assert set(agree) == {"indexer prefill", "top-k decode", "top-k prefill", "sparse MLA prefill (bf16 cache)",
                          "sparse MLA prefill (fp8 cache)"}, agree
    assert "--only indexer-prefill,top-k,mla-prefill" in lines[0]                     # said in the run's header
    assert r.stderr.count(" us\n") >= 4                                                # each row said as it is measured
    assert agree["top-k decode"] == "same sets", agree
    for kernel in ("indexer prefill", "sparse MLA prefill (bf16 cache)"):
        assert agree[kernel].startswith("rel diff") and float(agree[kernel].split()[-1]) < 1e-2, agree
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_dsa.py"), "--smoke", "--tilelang", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("bench_dsa: --tilelang"), r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_dsa.py"), "--smoke", "--only", "top-k,topk"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == ("bench_dsa: --only top-k,topk: unknown topk "
                                                                        "(groups: indexer-prefill, indexer-decode, top-k, "
                                                                        "mla-decode, mla-prefill)"), r.stderr


@pytest.mark.slow
def test_threads_flag(tiny):
    # torch on the CPU runs one intra-op thread unless told (a decode step's ops are too small to split);
    # the flag is checked, and refused where it means nothing
    for flags, what in ((["--backend", "torch", "--device", "cpu", "--threads", "0"], "--threads 0: must be >= 1"),
                        (["--threads", "2"], "applies to --backend torch --device cpu")):
        r = run("--ckpt", tiny, "--prompt", "hi", *flags)
        assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr
    import verify
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert verify.platform_id("torch", "cpu").endswith("torch threads 1")
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    return checkpoint.build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-v4", v4=True)


@pytest.mark.slow
def test_cli_runs_v4(tiny_v4, tmp_path):
    # DeepSeek-V4-Flash through the same command: dsml4 by default (no chat template), official numerics,
    # a batch, and an interactive chat (V4's caches cannot rewind: a turn whose prompt departs from the
    # cached tokens starts over)
    r = run("--ckpt", tiny_v4, "--prompt", "Hello, who are you?", "--max-new-tokens", 12, "--temperature", 0)
    assert r.returncode == 0, r.stderr
    assert "numerics=official attention=sparse indexer=fp4" in r.stderr and "chat_format=dsml4" in r.stderr
    assert "decode:" in r.stderr and len(r.stdout.strip()) > 0
    f = tmp_path / "prompts.txt"
    f.write_text("First prompt, short.\n\nA second prompt that is a good deal longer than the first one.\n")
    b = run("--ckpt", tiny_v4, "--input-file", f, "--max-new-tokens", 4, "--temperature", 0)
    assert b.returncode == 0 and b.stdout.count("Completion: ") == 2, b.stderr
    i = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny_v4), "--interactive",
                        "--max-new-tokens", "4", "--temperature", "0"],
                       input="hi\nand again\n/exit\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert i.returncode == 0 and i.stderr.count("prefill:") == 2, i.stderr
    e = run("--ckpt", tiny_v4, "--prompt", "x", "--indexer", "fp8")
    assert e.returncode == 2 and "indexer precision follows numerics" in e.stderr and "Traceback" not in e.stderr
    t = run("--ckpt", tiny_v4, "--prompt", "Hello, who are you?", "--max-new-tokens", 12, "--temperature", 0,
            "--backend", "torch", "--device", "cpu")
    assert t.returncode == 0 and "backend=torch" in t.stderr, t.stderr
    v = run("--ckpt", tiny_v4, "--verify", "--backend", "torch", "--device", "cpu")      # torch against NumPy, exact
    assert "VERIFY PASS" in v.stdout and "logits rel. error" in v.stdout, v.stdout + v.stderr


@pytest.mark.slow
def test_v4_interactive_never_rewinds(tiny_v4):
    # V4's caches cannot rewind: a turn continues at the cached length or starts over at 0, never between
    # (dsml4 with thinking drops the earlier reasoning from the history, so turn 2 departs from the cache)
    import io
    from types import SimpleNamespace
    from model import Transformer
    m = Transformer.from_pretrained(tiny_v4)
    tok = generate.load_tokenizer(tiny_v4)
    calls, real = [], m.forward
    m.forward = lambda tokens, start_pos=0, **kw: calls.append((start_pos, m.cached_len)) or real(tokens, start_pos, **kw)
    a = SimpleNamespace(chat_format="dsml4", thinking=True, tool_list=None, max_new_tokens=3, temperature=0)
    answers = iter(["hi", "again", "/exit"])
    generate.interactive(m, tok, a, np.random.default_rng(0), 1, read=lambda p: next(answers), out=io.StringIO())
    assert all(start in (0, cached) for start, cached in calls)
    assert sum(start == 0 for start, _ in calls) == 2                     # turn 2 started over


def test_v4_interactive_tool_round_trip(tiny_v4):
    # V4's chat: dsml4 tool calls parsed as they stream, the result asked for and fed back as a tool
    # message, with a scripted stand-in for the model (the tiny one never writes a well-formed call)
    import io
    from types import SimpleNamespace
    tok = generate.load_tokenizer(tiny_v4)
    call = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">\n'
            '<｜DSML｜parameter name="city" string="true">東京</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    script = tok.encode(call, add_special_tokens=False).ids + [1] + tok.encode("It is 10:00.", add_special_tokens=False).ids + [1]
    model = ScriptedModel(script)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    a = SimpleNamespace(chat_format="dsml4", thinking=False, tool_list=tools, max_new_tokens=200, temperature=0)
    answers = iter(["What time is it in Tokyo?", "10:00", "/exit"])
    out = io.StringIO()
    generate.interactive(model, tok, a, np.random.default_rng(0), 1, read=lambda p: next(answers), out=out)
    text = out.getvalue()
    assert '[tool call] {"name": "get_time", "arguments": {"city": "東京"}}' in text, text
    assert "It is 10:00." in text


# -----------------------------------------------------------------------------
# Sampling controls: top-k, top-p, repetition penalty, stop strings, a generator per row

def filtered_reference(logits, temperature, top_k, top_p):  # float64, by the definitions -> the distribution
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[:top_k]
    q = {i: p[i] / sum(p[j] for j in kept) for i in kept}
    total, nucleus = 0.0, []
    for i in kept:                                  # most likely first, until the mass reaches top_p
        nucleus.append(i)
        total += q[i]
        if total >= top_p:
            break
    out = np.zeros(len(p))
    out[nucleus] = [q[i] for i in nucleus]
    return out / out.sum()


@pytest.mark.parametrize("top_k, top_p", [(4, 1.0), (None, 0.75), (4, 0.75), (1, 0.5)])
def test_top_k_top_p_draw_from_the_filtered_distribution(top_k, top_p):
    logits = np.array([1.0, 2.3, 0.2, 1.9, -0.5, 1.5, 0.9], np.float32)
    want = filtered_reference(logits, 0.8, top_k or len(logits), top_p)
    s = generate.Sampling(temperature=0.8, top_k=top_k, top_p=top_p)
    rng = np.random.default_rng(1)
    draws = np.array([generate.draw(logits, s, rng, []) for _ in range(6000)])
    freq = np.bincount(draws, minlength=len(logits)) / len(draws)
    assert np.allclose(freq, want, atol=0.025), (freq, want)
    assert (freq[want == 0] == 0).all()                                 # a token cut is never drawn
    assert 0 < (want > 0).sum() < len(logits) or top_k is None and top_p == 1


def test_repetition_penalty_by_hand():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    out = generate.penalize(logits, np.array([0, 1, 1, 3]), 2.0)        # seen: 0, 1 (twice), 3
    assert out.tolist() == [1.0, -2.0, 0.5, 1.5] and logits[0] == 2.0    # the input left alone
    s = generate.Sampling(repetition_penalty=2.0)                        # greedy: 3 seen -> 1.5 < 2 would be 0's...
    assert generate.draw(logits, s, None, [3]) == 0                      # ... so 0 (2.0) wins over 3 (1.5)
    assert generate.draw(logits, generate.Sampling(), None, [3]) == 3


def scripted(tok, text):  # a ScriptedModel that writes `text` (then token 1 forever) -> (model, its token ids)
    ids = tok.encode(text, add_special_tokens=False).ids
    return ScriptedModel(ids), ids


@pytest.mark.parametrize("stop, text", [
    (["Stop"], "Hello world. "),
    (["here", "world", "zzz"], "Hello "),                       # several: the earliest in the text wins
    (["lo wor"], "Hel"),                                          # across a token boundary
    (["nowhere"], "Hello world. Stop here. More text"),           # none: the whole text (held tails released)
])
def test_stop_strings_end_and_are_cut(tiny, stop, text):
    tok = generate.load_tokenizer(tiny)
    whole = "Hello world. Stop here. More text"
    model, ids = scripted(tok, whole)
    assert tok.decode(ids[:1]) == "Hello" and tok.decode(ids[1:2]) == " world"   # "lo wor" spans two tokens
    pieces = []
    out, stats = generate.generate(model, [[5, 6]], 40, eos_id=1, tok=tok, stop=stop, on_text=pieces.append)
    assert stats["text"] == [text] and "".join(pieces) == text
    assert stats["finish_reason"] == ["stop"]
    if text != whole:                                             # ended at the token completing the stop string
        first, n = min((s for s in stop if s in whole), key=whole.find), len(out[0])   # the earliest in the text
        assert first not in tok.decode(ids[:n - 1]) and first in tok.decode(ids[:n]) and len(model.calls) == n
    with pytest.raises(ValueError, match="give the tokenizer"):
        generate.generate(ScriptedModel([5]), [[5, 6]], 4, eos_id=1, stop=["x"])


class LastTokenModel(ScriptedModel):
    """Logits from a fixed random table by each row's last token: a row's distribution depends on its
    own tokens only, so the batch cannot change it; only the sampler could."""

    def __init__(self, vocab=64):
        super().__init__([], vocab)
        self.table = np.random.default_rng(7).normal(size=(vocab, vocab)).astype(np.float32) * 2

    def forward(self, tokens, start_pos=0):
        return self.table[np.asarray(tokens)[:, -1]]


def test_each_row_samples_on_its_own():
    a = generate.Sampling(temperature=1.0, top_k=20, seed=5)
    b = generate.Sampling(temperature=0.7, top_p=0.9, repetition_penalty=1.3, seed=9)
    short, long = [1, 2, 3], [4, 5, 6, 7, 8, 9]                    # the long one is teacher-forced in the batch
    m = LastTokenModel()
    alone_a, _ = generate.generate(m, [short], 30, eos_id=-1, sampling=a)
    alone_b, _ = generate.generate(m, [long], 30, eos_id=-1, sampling=b)
    batch, _ = generate.generate(m, [short, long], 30, eos_id=-1, sampling=[a, b])
    swapped, _ = generate.generate(m, [long, short, short], 30, eos_id=-1, sampling=[b, a, b])
    assert batch == [alone_a[0], alone_b[0]] and swapped[:2] == [alone_b[0], alone_a[0]]
    assert len(set(map(tuple, batch))) == 2 and len(alone_a[0]) == 30
    other, _ = generate.generate(m, [short], 30, eos_id=-1, sampling=dataclasses.replace(a, seed=6))
    assert other != alone_a                                         # the seed matters
    with pytest.raises(ValueError, match="top_p 0: must be in"):
        generate.generate(m, [short], 3, eos_id=-1, top_p=0)


# -----------------------------------------------------------------------------
# Flags checked before the weights load

@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--top-k", "0"], "--top-k 0: must be an integer >= 1"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0: must be a finite number > 0 (1 is off)"),
    (["--stop", ""], "--stop '': a stop string must be a non-empty string"),
    (["--max-new-tokens", "100000000"], "prompt (5 tokens) + max_new_tokens (100000000) = 100000005 exceeds max_seq_len 1024"),
    (["--max-new-tokens", "900", "--max-seq-len", "800"], "prompt (5 tokens) + max_new_tokens (900) = 905 exceeds max_seq_len 800"),
    (["--raw", "--tools", "tools.json"], "--raw feeds the text as is, so --tools (which needs the chat format)"),
    (["--raw", "--thinking"], "--raw feeds the text as is, so --thinking"),
    (["--record-golden", "g.json"], "--record-golden needs --verify"),
    (["--tools", "none.json"], "--tools none.json: no such file"),
    (["--tools", "."], "--tools .: a folder, not a JSON file of tools"),
    (["--raw", "--chat-format", "v32exp"], "--raw feeds the text as is, so --chat-format (which chooses the chat format)"),
    (["--experts", "fp8"], "--experts fp8: an option of DeepSeek-V4 checkpoints; this one's experts are FP8 as stored"),
])
def test_bad_flags_are_refused_before_loading(tiny, capsys, monkeypatch, flags, message):
    def loading(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(generate.Transformer, "from_pretrained", loading)
    code, err = main_fails(capsys, "--ckpt", tiny, "--prompt", "x", *flags)
    assert code == 2 and err == [err[0]] and err[0].startswith("error: " + message), err


@pytest.mark.parametrize("source, message", [
    (["--input-file", "missing.txt"], "--input-file missing.txt: no such file"),
    (["--input-file", "."], "--input-file .: a folder, not a text file of prompts"),
    (["--verify-layers", "2"], "--verify-layers needs --verify"),               # not argparse's "one of ... is required"
    (["--record-golden", "g.json"], "--record-golden needs --verify"),
    (["--verify", "--experts", "fp8"], "--experts fp8 cannot go with --verify, which checks the experts as stored"),
    (["--interactive", "--max-new-tokens", "1024"], "--max-new-tokens 1024 leaves no room for a prompt in max_seq_len 1024"),
    (["--interactive", "--raw"], "--raw feeds the text as is, so --interactive"),
])
def test_bad_sources_are_refused_before_loading(tiny, capsys, monkeypatch, source, message):
    monkeypatch.setattr(generate.Transformer, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    code, err = main_fails(capsys, "--ckpt", tiny, *source)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: " + message), err


def test_no_source_is_still_argparses_usage_error(tiny, capsys):
    code, err = main_fails(capsys, "--ckpt", tiny)
    assert code == 2 and err[-1].endswith(": error: one of the arguments --prompt --input-file --interactive "
                                          "--verify is required")


@pytest.mark.parametrize("missing", ["numpy", "ml_dtypes", "tokenizers"])
def test_a_python_without_the_packages_names_setup_sh(tmp_path, missing):
    # `python3 generate.py ...` outside .venv was a ModuleNotFoundError traceback
    from helpers import missing_line, run_without
    r = run_without(tmp_path, [missing], "generate.py", "--ckpt", ROOT / "small-v32", "--prompt", "x")
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [missing_line("error: ", missing, "./setup.sh",
                                                                                "generate.py")], "")


def test_the_summary_counts_what_was_fed_and_what_came_out():
    # a batch's decode steps feed every row (a longer prompt's tokens teacher-forced, a row past its end): the
    # summary's "decode: 138 tokens" for 3 prompts x 40 new tokens read as if 138 were generated
    import io
    for eos, summary in ((-1, "decode: 5 steps x 2 rows = 10 tokens in .*; 8 new tokens \\(2 prompts, 4 each\\)"),
                         (12, "decode: 2 steps x 2 rows = 4 tokens in .*; 2 new tokens \\(2 prompts, 0 to 2 each\\)")):
        out, stats = generate.generate(ScriptedModel([10, 11, 12, 13, 14, 15]), [[1, 2, 3], [1, 2, 3, 4, 5]], 4, eos,
                                       temperature=0)
        assert stats["new_tokens"] == [len(c) for c in out] == ([4, 4] if eos < 0 else [2, 0])
        said = io.StringIO()
        generate.report(stats, err=said)
        assert re.fullmatch(r"\nprefill: 6 tokens in .*; " + summary + "\n", said.getvalue()), said.getvalue()
    said = io.StringIO()
    generate.report(generate.generate(ScriptedModel([10, 11, 12]), [[1, 2, 3]], 3, -1, temperature=0)[1], err=said)
    assert re.fullmatch(r"\nprefill: 3 tokens in .*; decode: 2 tokens in .*; 3 new tokens\n", said.getvalue())


def test_missing_torch_says_what_to_run(monkeypatch):
    import builtins
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "torch" else real(name, *a, **k))
    with pytest.raises(ValueError) as e:
        generate.resolve_device("torch", None)
    assert "\n" not in str(e.value) and "./setup.sh --torch" in str(e.value) and "./setup.sh --tests" in str(e.value)


def test_record_golden_names_the_file(tiny, tmp_path, monkeypatch):
    import verify
    seen = []
    monkeypatch.setattr(verify, "verify", lambda *a, **k: seen.append(k.get("record", "absent")) or 0)
    for flags in ([], ["--record-golden", str(tmp_path / "g.json")]):
        with pytest.raises(SystemExit) as e:
            generate.main(["--ckpt", str(tiny), "--verify", "--backend", "numpy", *flags])
        assert e.value.code == 0
    assert seen == [None, tmp_path / "g.json"]


# -----------------------------------------------------------------------------
# The chat: commands, Ctrl-C

def chat_with(model, tok, lines, **kw):  # interactive() fed `lines` -> its output
    # (an exception among the lines is raised by the read, as Ctrl-C would; a callable is called for its line)
    import io
    from types import SimpleNamespace
    a = SimpleNamespace(chat_format=kw.pop("fmt", "v32exp"), thinking=False, tool_list=None, max_new_tokens=kw.pop("n", 5),
                        temperature=0)
    lines, out = iter(lines), io.StringIO()

    def read(prompt):
        line = next(lines, EOFError())
        if isinstance(line, BaseException):
            raise line
        return line() if callable(line) else line
    generate.interactive(model, tok, a, np.random.default_rng(0), 1, read=read, out=out, **kw)
    return out.getvalue()


def test_chat_commands_and_empty_lines(tiny):
    tok = generate.load_tokenizer(tiny)
    model = ScriptedModel([])                                        # token 1 (EOS here) at once: an empty reply
    text = chat_with(model, tok, ["", "   ", "/help", "/frobnicate", "hi", "/clear", "hi", "/exit", "never read"])
    assert "/clear  forget the conversation" in text and "/exit   quit" in text
    assert "unknown command /frobnicate (/help lists the commands)" in text and "(conversation cleared)" in text
    starts = [s for s, n in model.calls]
    assert starts == [0, 0], model.calls                             # two replies, each from 0: /clear forgot the first


def test_chat_ctrl_c_at_the_prompt_asks_then_quits(tiny):
    tok = generate.load_tokenizer(tiny)
    model = ScriptedModel([])
    text = chat_with(model, tok, [KeyboardInterrupt(), "hi", KeyboardInterrupt(), "/exit"])
    assert text.count("Ctrl-C again") == 2 and len(model.calls) == 1   # not in a row: asked twice, went on
    with pytest.raises(KeyboardInterrupt):
        chat_with(model, tok, ["hi", KeyboardInterrupt(), KeyboardInterrupt(), "never read"])
    with pytest.raises(KeyboardInterrupt):                             # under torchrun: the first one ends the chat
        chat_with(model, tok, [KeyboardInterrupt(), "/exit"], stoppable=False)


class Interrupted:
    """Wraps a model's forward: once armed, its call number k runs, then Ctrl-C arrives (the caches have
    moved on, the chat's bookkeeping has not)."""

    def __init__(self, model):
        self.at, self.n, self.real = None, 0, model.forward
        model.forward = self

    def arm(self, k):
        self.at = self.n + k

    def __call__(self, tokens, start_pos=0, **kw):
        self.n += 1
        out = self.real(tokens, start_pos, **kw)
        if self.n == self.at:
            raise KeyboardInterrupt
        return out


class NoRewindModel(ScriptedModel):
    """A ScriptedModel with V4's cache contract: forward continues at the cached length or starts over at 0."""
    can_rewind = False
    cached_len = 0

    def forward(self, tokens, start_pos=0):
        if start_pos not in (0, self.cached_len):
            raise ValueError(f"start_pos {start_pos}: V4 continues its caches only at the cached length {self.cached_len}")
        self.cached_len = start_pos + np.asarray(tokens).shape[1]
        return super().forward(tokens, start_pos)


@pytest.mark.parametrize("k", [1, 2])                               # in the prefill chunk, in the decode
def test_a_stopped_reply_leaves_the_cache_bookkeeping_right(tiny, k):
    # replies that re-encode to the tokens generated, so the next turn would continue the caches where the
    # chat's bookkeeping says they end: after a stop it must say what they hold now (for V4: nothing usable)
    tok = generate.load_tokenizer(tiny)
    enc = lambda text: tok.encode(text, add_special_tokens=False).ids   # noqa: E731
    m = NoRewindModel(enc("Hello.") + [1] + enc("Sure, here")[:k] + enc("Fine.") + [1])
    stop = Interrupted(m)
    text = chat_with(m, tok, ["hi", lambda: stop.arm(k) or "again", "again"], n=20)
    assert text.split("\n[stopped]\n")[1] == "Fine.\n", text
    first, second, third = (s for s, n in m.calls if n > 1)         # each turn's prefill
    assert first == 0 and second > 0 and third == 0                  # turn 2 continued turn 1; turn 3 started over


@pytest.mark.slow
@pytest.mark.parametrize("k", [3])                                  # in the decode
def test_v4_chat_goes_on_after_a_stopped_reply(tiny_v4, k):
    # V4's caches cannot rewind: after a stopped reply the next turn must start from what the caches hold
    # (here: over), and the conversation must not hold the dropped exchange: the replies equal a chat's
    # without it (a chat that kept its bookkeeping from before the stop would continue caches that moved on)
    tok = generate.load_tokenizer(tiny_v4)
    m = Transformer.from_pretrained(tiny_v4)                         # each chat starts over at 0 (V4)
    first = chat_with(m, tok, ["hi"], fmt="dsml4")
    fresh = chat_with(m, tok, ["hi", "again"], fmt="dsml4")
    assert fresh.startswith(first) and len(fresh) > len(first) + 1
    stop = Interrupted(m)
    text = chat_with(m, tok, ["hi", lambda: stop.arm(k) or "again", "again"], fmt="dsml4")
    before, after = text.split("\n[stopped]\n")
    assert before.startswith(first) and after == fresh[len(first):], (text, fresh)


class Terminal:
    """A child on a pseudo-terminal as a user's shell runs it: its own session with the terminal as its
    controlling one, so Ctrl-C (\\x03 typed) is its SIGINT. Every wait bounded; close() kills it."""

    def __init__(self, args):
        import fcntl
        import os
        import signal
        import termios

        def child():                                   # (a background suite starts children with SIGINT ignored)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        self.fd, slave = os.openpty()
        self.p = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True,
                                  preexec_fn=child)
        os.close(slave)
        self.text, self.pos = "", 0                    # what it wrote ("\r\n" as "\n"); where expect() got to
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")   # a character may come in two reads

    def read(self, seconds):  # what comes within `seconds` -> False once the child has closed the terminal
        import os
        import select
        if not select.select([self.fd], [], [], seconds)[0]:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:                                # EIO: no writer left
            return False
        self.text += self.utf8.decode(data).replace("\r\n", "\n")
        return bool(data)

    def expect(self, what, timeout=60):  # wait until `what` is written after the last expect -> the text up to it
        end = time.monotonic() + timeout
        while what not in self.text[self.pos:]:
            assert time.monotonic() < end and self.read(min(1.0, end - time.monotonic())), (what, self.text[-3000:])
        start, self.pos = self.pos, self.text.index(what, self.pos) + len(what)
        return self.text[start:self.pos]

    def send(self, keys):
        import os
        os.write(self.fd, keys.encode())

    def close(self):
        import os
        self.p.kill()
        self.p.wait(timeout=30)
        os.close(self.fd)


@pytest.mark.slow
def test_chat_ctrl_c_on_a_terminal(tiny):
    # Ctrl-C during a reply stops it and the chat goes on without that exchange: the next reply is the
    # one a chat that never had it gives; Ctrl-C at the prompt asks, a second in a row quits (130)
    flags = ["--max-new-tokens", "40", "--temperature", "0"]
    fresh = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny), "--interactive", *flags],
                           input="hi\nagain\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert fresh.returncode == 0, fresh.stderr
    first, second = fresh.stdout.split(">>> ")[1:3]                  # each reply, then its line feed
    t = Terminal([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny), "--interactive", *flags])
    try:
        t.expect(">>> ")
        t.send("hi\r")
        t.expect("hi\n")
        assert t.expect(">>> ").startswith(first)                     # its report follows on stderr, the same terminal
        t.send("again\r")
        t.expect("again\n")
        end = time.monotonic() + 60
        while len(t.text) - t.pos < 8:                               # the reply is streaming
            assert time.monotonic() < end and t.read(1.0), t.text[-2000:]
        t.send("\x03")
        stopped = t.expect("[stopped]\n>>> ")
        assert "prefill:" not in stopped                             # no report: the reply never finished
        t.send("again\r")
        t.expect("again\n")
        reply = t.expect(">>> ")
        assert reply.startswith(second), (reply, second)
        time.sleep(1)                                                # (input() must be reading: a SIGINT between its
        t.send("\x03")                                               # prompt and its read waits for the next line)
        t.expect("Ctrl-C again")
        t.send("\x03")
        t.expect("interrupted")
        assert t.p.wait(timeout=30) == 130
    finally:
        t.close()


# -----------------------------------------------------------------------------
# The Python API, as a user calls it: from another folder, the repository put on sys.path

API_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import generate
from model import Transformer
ckpt = sys.argv[2]
model = Transformer.from_pretrained(ckpt)
tok = generate.load_tokenizer(ckpt)
messages = [{"role": "user", "content": "Hello, who are you?"}]
print(json.dumps({
    "pieces": list(generate.stream(model, tok, "Hello", 12)),
    "text": generate.complete(model, tok, "Hello", 12),
    "sampled": generate.complete(model, tok, "Hello", 12, temperature=0.8, top_k=1000, seed=3),
    "items": list(generate.stream(model, tok, messages, 12)),
    "reply": generate.complete(model, tok, messages, 12),
}))
"""


@pytest.mark.slow
def test_python_api_from_another_folder(tiny, tmp_path):
    script = tmp_path / "use_it.py"
    script.write_text(API_SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(ROOT), str(tiny)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    raw = run("--ckpt", tiny, "--prompt", "Hello", "--raw", "--max-new-tokens", 12, "--temperature", 0)
    sampled = run("--ckpt", tiny, "--prompt", "Hello", "--raw", "--max-new-tokens", 12, "--temperature", 0.8,
                  "--top-k", 1000, "--seed", 3)
    chat_cli = run("--ckpt", tiny, "--prompt", "Hello, who are you?", "--max-new-tokens", 12, "--temperature", 0)
    assert "".join(got["pieces"]) == got["text"] and len(got["pieces"]) > 1 and raw.stdout == got["text"] + "\n"
    assert sampled.stdout == got["sampled"] + "\n" and got["sampled"] != got["text"]
    reply = got["reply"]
    assert set(reply) == {"reasoning", "content", "tool_calls", "finish_reason", "errors"}
    assert reply["finish_reason"] == "length" and reply["reasoning"] is None and reply["content"]
    assert "".join(text for kind, text in got["items"] if kind == "content") == reply["content"]
    assert chat_cli.stdout == reply["content"] + "\n"
