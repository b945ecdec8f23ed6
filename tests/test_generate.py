"""generate.py end to end on the bundled tiny checkpoint (real tokenizer, chat format), the loop's
properties on the fixture model, and clear errors on bad input."""
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


def test_cli_batch_file_and_sampling(tiny, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("First prompt, short.\n\nA second prompt that is a good deal longer than the first one.\n")
    r = run("--ckpt", tiny, "--input-file", f, "--max-new-tokens", 8, "--temperature", 0.8, "--seed", 3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Prompt: ") == 2 and r.stdout.count("Completion: ") == 2


def test_cli_interactive_reuses_the_cache(tiny):
    r = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny), "--interactive",
                        "--max-new-tokens", "6", "--temperature", "0"],
                       input="hi\nand again\n/exit\n", capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import re
    first, second = map(int, re.findall(r"prefill: (\d+) tokens", r.stderr))
    # turn 2 renders the whole conversation (turn 1's prompt, its 6 answer tokens, EOS, the new user
    # turn), but only what the caches lack is prefilled
    assert second < first + 6


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
    _, rest = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in rest and rest.strip().splitlines()[-1] == "interrupted", rest


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_verify_passes_on_the_tiny_checkpoint(tiny, device):
    # on a GPU too: a golden recorded there must still match (a kernel change that moves the GPU's bits
    # must re-record it: python generate.py --ckpt tiny-v32 --verify --device cuda --record-golden)
    import json
    import verify
    r = run("--ckpt", tiny, "--verify", "--backend", "torch", "--device", device)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"1. torch on {device} against the NumPy reference" in r.stdout and "VERIFY PASS" in r.stdout
    assert r.stdout.count(" | ") >= 8                                       # a row per layer
    here = r.stdout.split("recorded on this platform: ", 1)[1].splitlines()[0]   # as the CLI runs (1 torch thread)
    recorded = json.loads(verify.GOLDENS.read_text()).get(verify.fingerprint(tiny), {}).get(here, {})
    if "torch/official/all" in recorded:                                   # the platform the goldens come from
        assert "greedy tokens match, logits hash matches" in r.stdout and "(2 comparisons)" in r.stdout
    else:                                                                  # elsewhere: said, and not a FAIL
        assert "no golden recorded for this platform" in r.stdout and "(1 comparison)" in r.stdout


def test_verify_goldens_are_per_platform_and_nothing_compared_is_no_pass(tiny, tmp_path):
    import io
    import json
    import verify
    goldens = tmp_path / "goldens.json"

    def check(**kw):
        out = io.StringIO()
        verdict = verify.verify(tiny, "numpy", None, "exact", layers=1, out=out, goldens_path=goldens, **kw)
        return verdict, out.getvalue()

    verdict, text = check()                                      # numpy vs numpy would check nothing
    assert verdict == verify.NOTHING and "VERIFY NOTHING COMPARED" in text and "PASS" not in text
    assert "no golden recorded for this platform" in text
    verdict, text = check(record=True)
    assert verdict == verify.NOTHING and "recorded in" in text
    verdict, text = check()
    assert verdict == verify.PASS and "greedy tokens match, logits hash matches" in text
    g = json.loads(goldens.read_text())
    (fp, platforms), = g.items()
    (where, entries), = platforms.items()
    assert where == verify.platform_id("numpy", None) and set(entries) == {"numpy/exact/1"}
    entries["numpy/exact/1"]["logits_bf16"] = "0" * 16                       # a golden this run does not reproduce
    goldens.write_text(json.dumps(g))
    verdict, text = check()
    assert verdict == verify.FAIL and "logits hash DIFFERS" in text and "VERIFY FAIL" in text
    goldens.write_text(json.dumps({fp: {"another CPU, 64 cores": entries}}))   # recorded elsewhere: not a FAIL
    verdict, text = check()
    assert verdict == verify.NOTHING and "no golden recorded for this platform" in text and "1 recorded" in text


def test_verify_layers_must_be_within_the_model(tiny):
    r = run("--ckpt", tiny, "--verify", "--verify-layers", "99")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--verify-layers 99: " in r.stderr and "has 4 layers, so N must be 1..4" in r.stderr and r.returncode == 2
    for flags, what in ((["--verify-layers", "2"], "--verify-layers"), (["--record-golden"], "--record-golden")):
        r = run("--ckpt", tiny, "--prompt", "hi", *flags)
        assert r.returncode == 2 and f"error: {what} needs --verify" in r.stderr and "Traceback" not in r.stderr


def test_verify_catches_the_old_indexer_rope(tiny, monkeypatch):
    # REF-old's bug: interleaved RoPE in the indexer. The torch path with that bug must fail --verify.
    import dataclasses
    import io
    import backend_torch
    import verify
    real = backend_torch.torch_ops

    def buggy(device):
        ops = real(device)
        return dataclasses.replace(ops, rope_half_split=ops.rope_interleaved)

    monkeypatch.setattr(backend_torch, "torch_ops", buggy)
    out = io.StringIO()
    assert verify.verify(tiny, "torch", "cpu", "exact", out=out) == verify.FAIL
    assert "beyond tolerance" in out.getvalue() and "VERIFY FAIL" in out.getvalue()


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


def test_v4_kernels_benchmark_script_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_v4_kernels.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    kernels = {line.split(" | ")[0].lstrip("| ") for line in r.stdout.splitlines()[4:]}
    assert {"mHC pair (hc_mix_pre + hc_post)", "compress_keys (CSA, m=4)", "compress_keys (HCA, m=16)", "index_scores_v4",
            "top-k (kernels_cuda.topk_indices)", "sparse_attention decode (CSA)", "fp4_moe_gemm (gate and up), gemv",
            "fp4_moe_gemm (gate and up), mma fp16", "fp4_moe_gemm (gate and up), mma int8"} <= kernels, kernels
    assert (tmp_path / "v4_kernels.json").is_file()


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
