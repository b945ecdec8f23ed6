"""check_engine.py against serve.py: a server running this code passes every case of the quick suite with
differences of exactly 0 (tiny-v32 and tiny-v4, subprocesses on 127.0.0.1); a server in this process whose
model has a fault injected past one position fails, naming the case and that position; bad input is one
line, exit 2."""
import contextlib
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import uvicorn

import generate
import serve
from conftest import ROOT
from model import Transformer
from test_serve import TIMEOUT, start, stop


def check(url, ckpt, *flags, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "check_engine.py"), "--url", url, "--ckpt", str(ckpt),
                           "--timeout", str(TIMEOUT), *flags], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-v32", "tiny-v4"])
def test_serve_passes_with_zero_difference(name, tmp_path):
    p, url = start(ckpt=ROOT / name)
    try:
        r = check(url, ROOT / name, "--out", str(tmp_path))
    finally:
        stop(p)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["model"] == name and report["worst"] == 0.0
    cases = {c["case"]: c for c in report["cases"]}
    assert {f"compress-mod4-r{i}" for i in range(4)} | {"past-index-topk", "prefix-cache", "greedy-decode"} <= set(cases)
    if name == "tiny-v4":                                             # sliding_window 16
        assert {"window-15", "window-16", "window-17"} <= set(cases)
    assert sorted(c["tokens"] % 4 for n, c in cases.items() if n.startswith("compress")) == [0, 1, 2, 3]
    assert all(c["verdict"] == "pass" and c["positions"] > 0 and c["top1_agree"] == c["top1_of"] for c in cases.values())
    assert cases["prefix-cache"]["prefix_vs_first"]["worst"] == 0.0
    assert cases["greedy-decode"]["parted_at"] is None and cases["greedy-decode"]["positions"] == 16
    assert "PASS" in r.stdout.splitlines()[-1]


FROM = 20                                              # the fault: logits perturbed from this position on


class Faulty:
    """The model with its logits perturbed at positions >= FROM (prefill rows and decode steps alike)."""

    def __init__(self, model):
        self.model = model
        self.noise = np.random.default_rng(0).normal(0, 2, model.args.vocab_size).astype(np.float32)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, start_pos=0, all_positions=False):
        logits = self.model.forward(tokens, start_pos=start_pos, all_positions=all_positions)
        n = np.asarray(tokens).shape[1]
        if all_positions:
            logits = logits.copy()
            logits[:, max(FROM - start_pos, 0):] += self.noise
        elif start_pos + n - 1 >= FROM:
            logits = logits + self.noise
        return logits


@contextlib.contextmanager
def serving(engine):  # serve.app(engine) on a free loopback port in a thread of this process -> its URL; then stopped
    sock, url = serve.bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(serve.app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert any(server.started or time.sleep(0.01) for _ in range(TIMEOUT * 100)), "the server did not start"
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=TIMEOUT)
        engine.stop()


@pytest.fixture
def faulty_url():  # tiny-v32 (exact numerics: faster) served with the fault
    ckpt = ROOT / "tiny-v32"
    model = Faulty(Transformer.from_pretrained(ckpt, numerics="exact"))
    with serving(serve.Engine(model, generate.load_tokenizer(ckpt), "v32exp", "tiny-v32")) as url:
        yield url


@pytest.mark.slow
def test_an_injected_fault_is_named_with_its_first_position(faulty_url, tmp_path):
    r = check(faulty_url, ROOT / "tiny-v32", "--numerics", "exact", "--out", str(tmp_path),
              *[f"--case={c}" for c in ("compress-mod4-r0", "past-index-topk", "greedy-decode")])
    assert r.returncode == 1, r.stdout + r.stderr
    cases = {c["case"]: c for c in json.loads((tmp_path / "report.json").read_text())["cases"]}
    assert cases["compress-mod4-r0"]["verdict"] == "pass" and cases["compress-mod4-r0"]["worst"] == 0.0   # 8 tokens
    bad = cases["past-index-topk"]
    assert bad["verdict"] == "FAIL" and bad["first_bad"] == FROM and max(bad["deltas"][:FROM]) == 0.0
    assert cases["greedy-decode"]["verdict"] == "FAIL"                 # its decode steps reach position FROM
    line = next(x for x in r.stdout.splitlines() if x.startswith("past-index-topk"))
    assert "FAIL" in line and f"at position {FROM}" in line
    assert r.stdout.splitlines()[-1].startswith("FAIL: past-index-topk, greedy-decode")


@pytest.mark.slow
def test_bad_input_is_one_line(faulty_url):
    for flags, want in ((("--url", "http://127.0.0.1:9/v1"), "Connection refused"),
                        (("--url", faulty_url, "--model", "nope"), "model 'nope' is not served"),
                        (("--url", faulty_url, "--case", "nothing"), "--case nothing: not in the quick suite")):
        r = subprocess.run([sys.executable, str(ROOT / "check_engine.py"), "--ckpt", str(ROOT / "tiny-v32"),
                            "--numerics", "exact", *flags], capture_output=True, text=True, timeout=TIMEOUT)
        lines = [x for x in r.stderr.splitlines() if x.startswith("error")]
        assert r.returncode == 2 and len(lines) == 1 and want in lines[0], r.stderr
