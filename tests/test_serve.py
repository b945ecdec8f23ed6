"""serve.py through the official openai client and raw HTTP: a server on 127.0.0.1 (a free port) as a
subprocess on the trained small-v32 (NumPy), checked against generate.complete and the model's own logits;
the tool round trip on a scripted stand-in model served in this process; bad requests, the queue, a
disconnect and the signals."""
import json
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx2
import numpy as np
import openai
import pytest
import uvicorn

import chat
import generate
import serve
from conftest import ROOT
from helpers import missing_line, run_without
from model import Transformer
from test_generate import ScriptedModel

CKPT = ROOT / "small-v32"
TIMEOUT = 60                                      # seconds any one wait may take


def start(*flags, ckpt=CKPT):  # serve.py as a user runs it -> (process, the API's URL)
    p = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--ckpt", str(ckpt), "--port", "0", *flags],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in iter(p.stdout.readline, "")] + [lines.put("")],
                     daemon=True).start()
    try:
        line = lines.get(timeout=TIMEOUT)
    except queue.Empty:
        line = ""
    if "http://127.0.0.1:" not in line:
        stop(p)
        raise AssertionError(f"no URL line from serve.py: {line!r}; stderr: {p.stderr.read()[-2000:]}")
    return p, line.split(" at ")[1].split()[0]


def stop(p, sig=signal.SIGTERM):  # -> the exit status; killed if it does not end in time
    if p.poll() is None:
        p.send_signal(sig)
    try:
        return p.wait(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
        return None


@pytest.fixture(scope="module")
def url():
    p, url = start("--max-queue", "1")
    yield url
    stop(p)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def model():
    return Transformer.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def tok():
    return generate.load_tokenizer(CKPT)


HI = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.mark.slow
def test_health_and_models(url, client):
    assert httpx2.get(url.removesuffix("/v1") + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["small-v32"]


@pytest.mark.slow
def test_chat_is_generate_complete_and_streams_the_same(client, model, tok):
    r = client.chat.completions.create(model="small-v32", messages=HI, max_tokens=12, temperature=0)
    oracle = generate.complete(model, tok, HI, 12, temperature=0)           # the CLI's path, not the server's
    assert r.choices[0].message.content == oracle["content"] and oracle["content"]
    assert r.choices[0].finish_reason == oracle["finish_reason"] == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model="small-v32", messages=HI, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == oracle["content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


@pytest.mark.slow
def test_thinking_gives_reasoning_apart(client):
    on = client.chat.completions.create(model="small-v32", messages=HI, max_tokens=6, temperature=0,
                                        extra_body={"chat_template_kwargs": {"thinking": True}})
    off = client.chat.completions.create(model="small-v32", messages=HI, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": {"thinking": False}})
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content   # no </think> yet
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    streamed = client.chat.completions.create(model="small-v32", messages=HI, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed) == \
        on.choices[0].message.reasoning_content


def log_softmax(logits):  # float64, by its definition
    z = np.asarray(logits, np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


@pytest.mark.slow
def test_completion_logprobs_are_the_models_own(client, model, tok):
    prompt = "def fibonacci(n):"
    r = client.completions.create(model="small-v32", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"prompt_logprobs": 2})
    c = r.choices[0]
    ids = tok.encode(prompt, add_special_tokens=False).ids
    new = generate.generate(model, [ids], 5, model.args.eos_token_id, temperature=0)[0][0]
    assert tok.decode(new) == c.text == generate.complete(model, tok, prompt, 5, temperature=0)
    # the logits the model gives as it generates: the prompt's prefill, then one decode step per token
    steps = [model.forward([ids], start_pos=0)[0]] + [model.forward([[t]], start_pos=len(ids) + i)[0]
                                                      for i, t in enumerate(new[:-1])]
    want = [log_softmax(row)[t] for row, t in zip(steps, new)]
    assert c.logprobs.token_logprobs == want                                  # the same float64 numbers
    for top, row in zip(c.logprobs.top_logprobs, steps):
        assert sorted(top.values(), reverse=True)[:3] == sorted(log_softmax(row))[::-1][:3]
    lp = np.array([log_softmax(row) for row in model.forward([ids], start_pos=0, all_positions=True)[0]])
    pl = c.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i, entry in enumerate(pl[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(lp[i - 1, ids[i]], abs=1e-12)
        assert own["rank"] == 1 + int((lp[i - 1] > lp[i - 1, ids[i]]).sum())
        assert len(entry) in (2, 3)                                           # its own and the top 2


@pytest.mark.slow
def test_completion_from_token_ids_with_echo_and_stream(client, tok):
    ids = tok.encode("import numpy as np", add_special_tokens=False).ids
    r = client.completions.create(model="small-v32", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("import numpy as np") and r.usage.prompt_tokens == len(ids)
    pieces = client.completions.create(model="small-v32", prompt=ids, max_tokens=4, temperature=0, stream=True)
    assert "import numpy as np" + "".join(p.choices[0].text for p in pieces) == r.choices[0].text


BAD = [  # (path, the request's fields over a good one, status, error.param)
    ("chat/completions", {"model": "nope"}, 404, "model"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("chat/completions", {"temperature": "hot"}, 400, "temperature"),
    ("chat/completions", {"temperature": -1}, 400, "temperature"),
    ("chat/completions", {"top_p": 0}, 400, "top_p"),
    ("chat/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ("chat/completions", {"max_tokens": 10 ** 6}, 400, "max_tokens"),
    ("chat/completions", {"n": 2}, 400, "n"),
    ("chat/completions", {"stop": [""]}, 400, "stop"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ("chat/completions", {"tools": {"name": "f"}}, 400, "tools"),
    ("chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {"reasoning_effort": "max"}, 400, "reasoning_effort"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"logprobs": 50}, 400, "logprobs"),
    ("completions", {"seed": -1}, 400, "seed"),
    ("completions", {"stream": "yes"}, 400, "stream"),
]


@pytest.mark.slow
def test_bad_requests_name_the_field(url):
    good = {"chat/completions": {"model": "small-v32", "messages": HI, "max_tokens": 1},
            "completions": {"model": "small-v32", "prompt": "x", "max_tokens": 1}}
    with httpx2.Client(timeout=TIMEOUT) as http:
        for path, change, status, param in BAD:
            r = http.post(f"{url}/{path}", json=good[path] | change)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, change, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        for body in (b"{not json", b"[1, 2]", b'{"model": NaN}'):
            r = http.post(f"{url}/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and "error" in r.json(), body
        r = http.post(f"{url}/chat/completions", content=b" " * (1 << 20 | 1))
        assert r.status_code == 413 and "error" in r.json()
        assert http.get(f"{url}/nowhere").status_code == 404
        assert http.post(f"{url}/completions", json=good["completions"]).status_code == 200   # still serving


def stream_open(http, url, max_tokens):  # a streamed completion begun -> (its response, its line iterator)
    cm = http.stream("POST", f"{url}/completions", json={"model": "small-v32", "prompt": "def", "stream": True,
                                                         "max_tokens": max_tokens, "temperature": 0})
    r = cm.__enter__()
    return cm, r.iter_lines()


@pytest.mark.slow
def test_queue_full_is_429_and_a_dropped_stream_stops(url):
    # --max-queue 1: one running (a long stream), one waiting; the third is refused. Both streams are
    # then dropped mid-way: were their generations not stopped, the next request would wait minutes.
    with httpx2.Client(timeout=TIMEOUT) as http:
        running, lines = stream_open(http, url, 1500)
        assert next(line for line in lines if line.startswith("data: "))
        waiting, _ = stream_open(http, url, 1500)
        r = http.post(f"{url}/completions", json={"model": "small-v32", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        waiting.__exit__(None, None, None)
        running.__exit__(None, None, None)
        t0 = time.perf_counter()
        for _ in range(50):                                   # the server sees the disconnects within moments
            r = http.post(f"{url}/completions", json={"model": "small-v32", "prompt": "x", "max_tokens": 2})
            if r.status_code != 429:
                break
            time.sleep(0.05)
        assert r.status_code == 200 and time.perf_counter() - t0 < 10


# -----------------------------------------------------------------------------
# Tools: a scripted stand-in model served in this process (the small model never writes a call)

class Recording(ScriptedModel):  # keeps each prefill's tokens
    def __init__(self, script):
        super().__init__(script)
        self.args.eos_token_id = 1
        self.prompts = []

    def forward(self, tokens, start_pos=0):
        if start_pos == 0:
            self.prompts.append(np.asarray(tokens)[0].tolist())
        return super().forward(tokens, start_pos)


@pytest.fixture(scope="module")
def tiny_tok():  # the DeepSeek-V3 tokenizer (its tool markers are tokens that decode; small-v32's are special)
    return generate.load_tokenizer(ROOT / "tiny-v32")


@pytest.fixture
def scripted(tiny_tok):  # (model, base URL) of a server in a thread of this process; stopped after the test
    tok, model = tiny_tok, Recording([])
    sock, url = serve.bind("127.0.0.1", 0)
    engine = serve.Engine(model, tok, "v32exp", "scripted")
    server = uvicorn.Server(uvicorn.Config(serve.app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield model, url
    server.should_exit = True
    thread.join(timeout=TIMEOUT)
    engine.stop()


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "the time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_call_round_trip(scripted, tiny_tok):
    tok = tiny_tok
    model, url = scripted
    args = {"city": "東京"}
    call = chat.encode([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": args}}]}], fmt="v32exp",
        add_generation_prompt=False)                         # the call as the format writes it, from the encoder
    call = call[call.index(chat.CALLS_BEGIN):call.index(chat.CALLS_END) + len(chat.CALLS_END)]
    writes = tok.encode(call, add_special_tokens=False).ids + [1]
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT)
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]

    model.script = list(writes)
    r = client.chat.completions.create(model="scripted", messages=ask, tools=TOOLS, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (tc,) = c.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_time" and tc.id.startswith("call_")
    assert isinstance(tc.function.arguments, str) and json.loads(tc.function.arguments) == args

    model.script = list(writes)                              # streamed: the same call, arguments in pieces
    chunks = list(client.chat.completions.create(model="scripted", messages=ask, tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_time"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("｜" not in (ch.choices[0].delta.content or "") for ch in chunks)   # no markup as content

    model.script = tok.encode("It is 10:00.", add_special_tokens=False).ids + [1]
    history = ask + [c.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "10:00"}]
    r = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS, temperature=0)
    assert r.choices[0].message.content == "It is 10:00." and r.choices[0].finish_reason == "stop"
    assert tok.decode(model.prompts[-1], skip_special_tokens=False) == chat.encode(
        [ask[0], {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_time",
                                                                                    "arguments": tc.function.arguments}}]},
         {"role": "tool", "content": "10:00"}], fmt="v32exp", tools=TOOLS)

    model.script = list(writes)                              # tool_choice none: no tools in the prompt
    client.chat.completions.create(model="scripted", messages=ask, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert "get_time" not in tok.decode(model.prompts[-1])


# -----------------------------------------------------------------------------
# Stopping

@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_it_cleanly(sig):
    p, url = start()
    try:
        with httpx2.Client(timeout=TIMEOUT) as http:
            streaming, lines = stream_open(http, url, 1500)        # a reply in progress ends at its next token
            assert next(line for line in lines if line.startswith("data: "))
            assert stop(p, sig) == 0
            streaming.__exit__(None, None, None)
    finally:
        stop(p, signal.SIGKILL)
    assert "Traceback" not in p.stderr.read()


def test_bad_flags_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--ckpt", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: --ckpt {tmp_path / 'none'}: no such folder"]


def test_a_python_without_starlette_names_setup_serve(tmp_path):
    r = run_without(tmp_path, ["starlette"], "serve.py", "--ckpt", "small-v32")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [missing_line("error: ", "starlette", "./setup.sh --serve", "serve.py")]


@pytest.mark.slow
def test_v4_chat_with_thinking_is_generate_complete():
    # DeepSeek-V4-Flash (the bundled tiny-v4: random weights, the real tokenizer and dsml4 format) through
    # the server, thinking on, whole and streamed, against generate.complete on the same messages
    ckpt = ROOT / "tiny-v4"
    p, url = start(ckpt=ckpt)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=TIMEOUT)
        kw = dict(model="tiny-v4", messages=HI, max_tokens=10, temperature=0,
                  extra_body={"chat_template_kwargs": {"thinking": True}})
        r = client.chat.completions.create(**kw)
        m = Transformer.from_pretrained(ckpt)
        oracle = generate.complete(m, generate.load_tokenizer(ckpt), HI, 10, thinking=True, temperature=0)
        got = r.choices[0].message
        assert (getattr(got, "reasoning_content", None), got.content or None) == (oracle["reasoning"], oracle["content"])
        assert oracle["reasoning"]                                              # the reply opened with reasoning
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == oracle["reasoning"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == (oracle["content"] or "")
    finally:
        assert stop(p) == 0


def test_top_k_is_a_stable_sorts_first_k():
    # the logprobs' top entries without sorting the vocabulary: the order of a stable sort, ties included
    rng = np.random.default_rng(0)
    for _ in range(2000):
        lp = rng.integers(-3, 3, int(rng.integers(1, 40))).astype(np.float64)      # many ties
        k = int(rng.integers(0, 45))
        assert serve.top_k(lp, k) == np.argsort(-lp, kind="stable")[:k].tolist(), (lp, k)
