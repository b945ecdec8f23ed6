"""An OpenAI-compatible HTTP server for a DeepSeek-V3.2-Exp or V4-Flash checkpoint (a first step).

    .venv/bin/python serve.py --ckpt small-v32                  http://127.0.0.1:8000/v1 (after ./setup.sh --serve)
    .venv/bin/python serve.py --ckpt tiny-v4 --port 0            a free port: the line printed when ready names it
    .venv/bin/python serve.py --ckpt DIR --backend torch --device cuda    generate.py's loading flags, the same checks

It loads the model as generate.py does, binds --host (default 127.0.0.1, loopback only) and --port, prints
one line with the URL once it serves, and stops on SIGINT or SIGTERM (exit 0; a reply in progress ends at
its next token). Bad flags or files: one line "error: ...", exit 2.

The API, in OpenAI's shapes (any OpenAI client: base_url = the printed URL, any api_key):

    GET  /health                {"status": "ok"}
    GET  /v1/models             the one model, named after the checkpoint's folder (--model-name)
    POST /v1/chat/completions   messages (system, developer, user, assistant with tool_calls and
                                reasoning_content, tool) rendered by chat.encode in the checkpoint's chat
                                format; the reply parsed by chat.StreamParser: message.content,
                                message.reasoning_content apart, message.tool_calls (id, type "function",
                                function.name, function.arguments as a JSON string), finish_reason stop /
                                length / tool_calls, usage. Streamed (stream: true) as server-sent events,
                                "data: {chunk}" then "data: [DONE]": the deltas carry reasoning_content,
                                content and each call's arguments as they are decoded (never DSML markup).
    POST /v1/completions        prompt as text or token ids; text in, text out (echo prepends the prompt);
                                logprobs: N (the N most likely tokens at each step, and the chosen one);
                                vLLM's prompt_logprobs: N (each prompt token's own logprob, its rank, the top N)

Request fields: model (the served name), max_tokens or max_completion_tokens (default: the rest of the
context), temperature (default 1), top_p, top_k (vLLM's; -1 or 0: off), repetition_penalty (vLLM's), stop
(a string or a list), seed (default: a fresh random one), stream, stream_options.include_usage, tools and
tool_choice "auto" or "none" (none: the tools are left out of the prompt), thinking by
chat_template_kwargs {"thinking": true} (or "enable_thinking", as vLLM and SGLang take it), reasoning_effort
("max" in V4's dsml4 format; low, medium, high are its default). Sampling is generate.Sampling, the
CLI's: the same tokens as generate.complete for the same prompt and options. Logprobs are float64
log-softmaxes of the model's own logits (before the repetition penalty, temperature, top-k and top-p).

Errors: {"error": {"message", "type", "param", "code"}} naming the field: 400 for a malformed body, a field of
the wrong type or range, a prompt that leaves no room in the context, n > 1 or a field not supported yet;
404 for an unknown model or path; 413 for a body over --max-body-bytes (refused before it is parsed); 429
when --max-queue requests already wait.

Scheduling in this step: one request at a time, in arrival order, on one model thread (a batch of one;
each request prefills its whole prompt). A client that disconnects mid-stream stops its generation at the
next token. Not done yet: continuous batching (several requests sharing the model's steps), CUDA-graph
decode here (generate.py's decode uses one; the server's logprob path does not), a chat page, a
benchmark, n > 1, several prompts per request, logprobs on chat completions, tool_choice "required" or
a named function, response_format, presence / frequency penalties and logit_bias.
"""
import argparse
import asyncio
import json
import math
import collections
import secrets
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import progress

with progress.needs_setup("serve.py", "./setup.sh --serve", active=__name__ == "__main__"):
    import numpy as np
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    import chat
    import checkpoint
    import generate


class ApiError(Exception):
    """A request refused: the HTTP status and OpenAI's error object, naming the field (param)."""

    def __init__(self, status, message, param=None, code=None, kind=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self):
        return JSONResponse(self.body(), status_code=self.status)


# -----------------------------------------------------------------------------
# Requests: each field checked, a bad one an ApiError naming it

KINDS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
         "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
         "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def field(body, name, kind, default=None, where=None):  # body[name] of this JSON kind, or default when absent / null
    v = body.get(name)
    if v is None:
        return default
    if not KINDS[kind](v):
        article = "an" if kind[0] in "aeiou" else "a"
        raise ApiError(400, f"{where or name}: expected {article} {kind}, got {checkpoint.json_type(v)}", where or name)
    return v


def check_common(body, served):  # the fields every generation request shares
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, f"model: expected a string naming the model ({served}), got {checkpoint.json_type(model)}",
                       "model")
    if model != served:
        raise ApiError(404, f"model {model!r} does not exist here; this server serves {served!r}", "model",
                       "model_not_found")
    if field(body, "n", "integer", 1) != 1:
        raise ApiError(400, "n: only 1 choice per request is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if field(body, name, "number", 0) != 0:
            raise ApiError(400, f"{name}: not supported (repetition_penalty is)", name)
    if body.get("logit_bias"):
        raise ApiError(400, "logit_bias: not supported", "logit_bias")
    field(body, "stream", "boolean")
    options = field(body, "stream_options", "object", {})
    field(options, "include_usage", "boolean", where="stream_options.include_usage")


def sampling_of(body):  # -> generate.Sampling
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if not (stop is None or isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "stop: expected a non-empty string or a list of them", "stop")
    top_k = field(body, "top_k", "integer")
    seed = field(body, "seed", "integer")
    options = dict(temperature=field(body, "temperature", "number", 1.0), top_p=field(body, "top_p", "number", 1.0),
                   top_k=None if top_k in (-1, 0) else top_k,
                   repetition_penalty=field(body, "repetition_penalty", "number", 1.0), stop=tuple(stop or ()),
                   seed=secrets.randbits(63) if seed is None else seed)
    try:
        return generate.Sampling(**options)
    except ValueError as e:                                    # check_sampling's message starts with the field
        name = str(e).split()[0]
        raise ApiError(400, str(e), name if name in options else None) from None


def max_tokens_of(body, names, n_prompt, context, prompt_param):  # the reply's token budget within the context
    if n_prompt >= context:
        raise ApiError(400, f"the prompt ({n_prompt} tokens) leaves no room in the context ({context} tokens)",
                       prompt_param, "context_length_exceeded")
    for name in names:
        n = field(body, name, "integer")
        if n is None:
            continue
        if n < 1:
            raise ApiError(400, f"{name} {n}: must be at least 1", name)
        if n_prompt + n > context:
            raise ApiError(400, f"prompt ({n_prompt} tokens) + {name} ({n}) = {n_prompt + n} exceeds the context "
                           f"({context} tokens)", name, "context_length_exceeded")
        return n
    return context - n_prompt


def text_of(content, where):  # a message's content: a string, null, or a list of text parts -> str or None
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: expected a string or a list of text parts ({{\"type\": \"text\", \"text\": ...}})",
                   where)


def tool_calls_of(calls, where):  # an assistant message's tool_calls -> the shape chat.encode reads
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}: expected an array, got {checkpoint.json_type(calls)}", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]):
            raise ApiError(400, f"{where}[{j}]: expected {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}",
                           f"{where}[{j}].function")
        args = f.get("arguments", "{}")
        try:
            ok = isinstance(json.loads(args) if isinstance(args, str) else args, dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise ApiError(400, f"{where}[{j}].function.arguments: expected a JSON object (as a string)",
                           f"{where}[{j}].function.arguments")
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def messages_of(body, fmt):  # OpenAI messages -> chat.encode's, checked
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise ApiError(400, "messages: expected a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where}: expected an object, got {checkpoint.json_type(m)}", where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"{where}.role: expected system, developer, user, assistant or tool, got {role!r}",
                           f"{where}.role")
        msg = {"role": role, "content": text_of(m.get("content"), f"{where}.content")}
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:                            # dsml32 reads reasoning_content, dsml4 reasoning
                msg["reasoning" if fmt == "dsml4" else "reasoning_content"] = text_of(reasoning,
                                                                                      f"{where}.reasoning_content")
            if m.get("tool_calls"):
                msg["tool_calls"] = tool_calls_of(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def chat_prompt(body, fmt):  # -> (prompt text, the tools the parser knows)
    kwargs = field(body, "chat_template_kwargs", "object", {})
    try:
        thinking = chat.resolve_thinking(kwargs.get("thinking"), kwargs.get("enable_thinking"))
    except ValueError as e:
        raise ApiError(400, f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    effort = field(body, "reasoning_effort", "string")
    if effort not in (None, "low", "medium", "high", "max") or effort == "max" and fmt != "dsml4":
        raise ApiError(400, f"reasoning_effort {effort!r}: low, medium or high (the default effort)"
                       + (", or max" if fmt == "dsml4" else f"; max is V4's (dsml4), this model's format is {fmt}"),
                       "reasoning_effort")
    tools = body.get("tools")
    if tools is not None:
        try:
            generate.check_tools(tools, "tools")
        except ValueError as e:
            raise ApiError(400, str(e), "tools") from None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"tool_choice {choice!r}: \"auto\" or \"none\" (required and named functions: not yet)",
                       "tool_choice")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: not supported yet", "response_format")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs: not supported on chat completions yet (/v1/completions has them)", "logprobs")
    tools = None if choice == "none" or not tools else tools
    try:
        prompt = chat.encode(messages_of(body, fmt), fmt=fmt, thinking=thinking, tools=tools,
                             reasoning_effort="max" if effort == "max" else None)
    except (ValueError, KeyError, TypeError) as e:             # e.g. a tool result without its call (DSML)
        raise ApiError(400, f"messages: {e}", "messages") from None
    return prompt, tools


def completion_prompt(body, tok, vocab):  # -> (prompt text, token ids)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                       # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt, tok.encode(prompt, add_special_tokens=False).ids
    if isinstance(prompt, list) and prompt and all(KINDS["integer"](t) and 0 <= t < vocab for t in prompt):
        return tok.decode(prompt, skip_special_tokens=False), list(prompt)
    raise ApiError(400, f"prompt: expected a non-empty string or a list of token ids in [0, {vocab}) (one prompt "
                   "per request)", "prompt")


def logprobs_count(body, name):  # logprobs / prompt_logprobs: an integer in [0, 20], or absent
    n = field(body, name, "integer")
    if n is not None and not 0 <= n <= 20:
        raise ApiError(400, f"{name} {n}: must be in [0, 20]", name)
    return n


# -----------------------------------------------------------------------------
# The model's thread: one job at a time from a bounded queue; events go back to the request's event loop

class Job:
    """One request's work on the model thread; what it sends comes out of items() on the event loop."""

    def __init__(self, work, loop):
        self.work, self.loop, self.events, self.cancelled = work, loop, asyncio.Queue(), threading.Event()

    def send(self, item):  # from the model thread: a dict, an ApiError, or None (the end)
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:                                     # the loop has closed: the server is gone
            self.cancelled.set()

    async def items(self):  # the dicts sent; an ApiError sent is raised; leaving early cancels the job
        try:
            while (item := await self.events.get()) is not None:
                if isinstance(item, ApiError):
                    raise item
                yield item
        finally:
            self.cancelled.set()


class Recorder:
    """The model, with the logits of its last forward kept (NumPy, [B, vocab]) for logprobs."""

    def __init__(self, model):
        self.model, self.last = model, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, start_pos=0):
        logits = self.model.forward(tokens, start_pos=start_pos)
        self.last = logits if isinstance(logits, np.ndarray) else logits.float().cpu().numpy()
        return self.last


def log_softmax(logits):  # [..., V] logits -> float64 log-probabilities
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


class Engine:
    """The loaded model, its tokenizer and chat format, one worker thread and the queue in front of it."""

    def __init__(self, model, tok, fmt, name, max_queue=16):
        self.model, self.tok, self.fmt, self.name = model, tok, fmt, name
        self.context, self.eos = model.args.max_seq_len, model.args.eos_token_id
        self.vocab = tok.get_vocab_size(with_added_tokens=True)
        self.max_queue, self.waiting, self.ready = max_queue, collections.deque(), threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self.thread.start()

    def submit(self, work):  # on the event loop: work(job) will run on the model thread -> the Job
        job = Job(work, asyncio.get_running_loop())
        with self.ready:
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())  # clients gone
            if len(self.waiting) >= self.max_queue:
                raise ApiError(429, f"{self.max_queue} requests are already waiting; try again later", None,
                               "queue_full", "rate_limit_error")
            self.waiting.append(job)
            self.ready.notify()
        return job

    def stop(self):  # the reply in progress ends at its next token, the waiting ones are refused; the thread ends
        with self.ready:
            self.stopping.set()
            for job in self.waiting:
                job.send(ApiError(503, "the server is shutting down"))
            self.waiting.clear()
            self.ready.notify()
        self.thread.join(timeout=10)

    def _next(self):  # on the model thread: the next job, waiting for one; None once stopping
        with self.ready:
            while not self.waiting and not self.stopping.is_set():
                self.ready.wait()
            return None if self.stopping.is_set() else self.waiting.popleft()

    def _loop(self):
        while (job := self._next()) is not None:
            try:
                if not job.cancelled.is_set():
                    job.work(job)
            except Exception as e:                               # a bug, not bad input: this request fails alone
                print(f"serve: internal error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                job.send(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
            job.send(None)

    def run(self, job, ids, max_tokens, sampling, on_token, logits=False):
        """Generate on the model thread: on_token(token id or None, text piece, [V] logits or None) for each
        token (None: the held tail at the end) -> generate's stats, or None once the job is cancelled or the
        server stops (checked before each token)."""
        model = Recorder(self.model) if logits else self.model
        steps = generate.generate_steps(model, [ids], max_tokens, self.eos, sampling, tok=self.tok,
                                        cuda_graph=not logits)        # a replayed graph would bypass the Recorder
        try:
            while not (job.cancelled.is_set() or self.stopping.is_set()):
                try:
                    token, piece = next(steps)
                except StopIteration as end:
                    return end.value[1]
                on_token(token, piece, model.last[0] if logits and token is not None else None)
            if self.stopping.is_set():
                job.send(ApiError(503, "the server is shutting down"))
            return None
        finally:
            steps.close()

    def token_text(self, token_id):
        return self.tok.decode([int(token_id)], skip_special_tokens=False)

    # --- the two kinds of work ----------------------------------------------------------------------------

    def chat_work(self, ids, prompt, tools, max_tokens, sampling):
        """Sends {"delta": ...} per parsed piece, then {"finish_reason", "tool_calls", "usage"}."""
        def work(job):
            parser, index, heads, calls = chat.StreamParser(self.fmt, prompt, tools), {}, {}, []

            def deltas(events):
                for e in events:
                    kind = e["type"]
                    if kind in ("reasoning", "content") and e["text"]:
                        job.send({"delta": {"reasoning_content" if kind == "reasoning" else "content": e["text"]}})
                    elif kind == "tool_call":                    # the name is complete: the call's first delta
                        index[e["index"]], heads[e["index"]] = len(index), (e["id"], e["name"])
                        job.send({"delta": {"tool_calls": [{"index": index[e["index"]], "id": e["id"],
                                                            "type": "function",
                                                            "function": {"name": e["name"], "arguments": ""}}]}})
                    elif kind == "tool_call_arguments" and e["index"] in index:
                        job.send({"delta": {"tool_calls": [{"index": index[e["index"]],
                                                            "function": {"arguments": e["text"]}}]}})
                    elif kind == "tool_call_done":
                        call_id, name = heads[e["index"]]
                        calls.append({"id": call_id, "type": "function",
                                      "function": {"name": name, "arguments": e["arguments"]}})

            stats = self.run(job, ids, max_tokens, sampling, lambda t, piece, _: piece and deltas(parser.feed(piece)))
            if stats is None:
                return
            deltas(parser.finish())
            reason = "tool_calls" if calls else stats["finish_reason"][0]
            job.send({"finish_reason": reason, "tool_calls": calls, "usage": usage(len(ids), stats["new_tokens"][0])})
        return work

    def completion_work(self, ids, max_tokens, sampling, logprobs, prompt_logprobs, echo):
        """Sends {"text", "logprobs"?} per piece (with echo first the prompt), {"prompt_logprobs"} when asked,
        then {"finish_reason", "usage"}."""
        def work(job):
            if prompt_logprobs is not None or echo and logprobs is not None:
                lp = self.prompt_logprobs(ids, max(prompt_logprobs or 0, logprobs or 0))
                if prompt_logprobs is not None:
                    job.send({"prompt_logprobs": [None] + [trim(d, prompt_logprobs) for d in lp[1:]]})
            if echo:
                text = self.tok.decode(ids, skip_special_tokens=False)
                job.send({"text": text} | ({} if logprobs is None else {"logprobs": [
                    (self.token_text(t), None if d is None else d[str(t)]["logprob"],
                     None if d is None else top_of(d, logprobs)) for t, d in zip(ids, lp)]}))

            def on_token(token, piece, logits):
                item = {"text": piece}
                if token is not None and logprobs is not None:
                    lp = log_softmax(logits)
                    item["logprobs"] = [(self.token_text(token), float(lp[token]), self.top(lp, logprobs, token))]
                job.send(item)

            stats = self.run(job, ids, max_tokens, sampling, on_token, logits=logprobs is not None)
            if stats is not None:
                job.send({"finish_reason": stats["finish_reason"][0], "usage": usage(len(ids), stats["new_tokens"][0])})
        return work

    def top(self, lp, k, chosen):  # {token text: logprob} of the k most likely tokens and the chosen one
        best = top_k(lp, k)
        return {self.token_text(t): float(lp[t]) for t in best + [chosen] * (chosen not in best)}

    def prompt_logprobs(self, ids, k):
        """vLLM's prompt_logprobs: per prompt token (the first: None) {token id: {"logprob", "rank",
        "decoded_token"}} for the token itself and the k most likely, from one forward over the prompt."""
        logits = self.model.forward([ids], start_pos=0, all_positions=True)
        logits = logits if isinstance(logits, np.ndarray) else logits.float().cpu().numpy()
        out = [None]
        for t, lp in zip(ids[1:], log_softmax(logits[0, :-1])):
            best = top_k(lp, k)
            out.append({str(i): {"logprob": float(lp[i]), "rank": int((lp > lp[i]).sum()) + 1,
                                 "decoded_token": self.token_text(i)} for i in [t] + [i for i in best if i != t]})
        return out


def top_k(lp, k):  # the k largest entries' indices, best first, ties toward the lower index (a stable sort's
    if k <= 0:       # order), without sorting the whole vocabulary
        return []
    if k >= len(lp):
        return np.argsort(-lp, kind="stable").tolist()
    v = np.partition(lp, len(lp) - k)[len(lp) - k]                               # the k-th largest value
    above = np.flatnonzero(lp > v)
    best = np.concatenate([above, np.flatnonzero(lp == v)[:k - len(above)]])
    return best[np.lexsort((best, -lp[best]))].tolist()


def trim(d, k):  # a prompt_logprobs entry cut to its own token and the k most likely
    first = next(iter(d))
    return {i: v for i, v in d.items() if i == first or v["rank"] <= k}


def top_of(d, k):  # a prompt_logprobs entry -> completions' top_logprobs shape {token text: logprob}
    return {v["decoded_token"]: v["logprob"] for i, v in d.items() if v["rank"] <= k or i == next(iter(d))}


def usage(prompt, completion):
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -----------------------------------------------------------------------------
# HTTP: the routes

def app(engine, max_body_bytes=1 << 20):
    """The Starlette application serving `engine`."""

    async def body_of(request):  # the JSON object of the body; refused (413) past max_body_bytes before parsing
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise ApiError(413, f"the request body ({length} bytes) is over the limit ({max_body_bytes} bytes)",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise ApiError(413, f"the request body is over the limit ({max_body_bytes} bytes)",
                               code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the body is not valid JSON ({str(e)[:100]})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {checkpoint.json_type(body)}")
        return body

    def handled(fn):  # an ApiError -> its JSON response
        async def endpoint(request):
            try:
                return await fn(request)
            except ApiError as e:
                return e.response()
        return endpoint

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                                         "owned_by": "dsa-ref", "max_model_len": engine.context}]})

    async def chat_completions(request):
        body = await body_of(request)
        check_common(body, engine.name)
        sampling = sampling_of(body)
        prompt, tools = chat_prompt(body, engine.fmt)
        ids = engine.tok.encode(prompt, add_special_tokens=False).ids
        n = max_tokens_of(body, ("max_completion_tokens", "max_tokens"), len(ids), engine.context, "messages")
        job = engine.submit(engine.chat_work(ids, prompt, tools, n, sampling))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}
        if body.get("stream"):
            return events(job, head, "chat.completion.chunk", chat_chunks, body)
        message, final = {"role": "assistant", "content": "", "reasoning_content": ""}, None
        async for item in job.items():
            if "delta" in item:
                for key in ("content", "reasoning_content"):
                    message[key] += item["delta"].get(key, "")
            else:
                final = item
        if final is None:
            raise ApiError(503, "the reply was stopped")
        message = {"role": "assistant", "content": message["content"] or (None if final["tool_calls"] else ""),
                   "reasoning_content": message["reasoning_content"] or None} | \
            ({"tool_calls": final["tool_calls"]} if final["tool_calls"] else {})
        return JSONResponse(head | {"object": "chat.completion", "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": final["finish_reason"]}],
            "usage": final["usage"]})

    async def completions(request):
        body = await body_of(request)
        check_common(body, engine.name)
        sampling = sampling_of(body)
        _, ids = completion_prompt(body, engine.tok, engine.vocab)
        n = max_tokens_of(body, ("max_tokens",), len(ids), engine.context, "prompt")
        echo = field(body, "echo", "boolean", False)
        logprobs, prompt_logprobs = logprobs_count(body, "logprobs"), logprobs_count(body, "prompt_logprobs")
        job = engine.submit(engine.completion_work(ids, n, sampling, logprobs, prompt_logprobs, echo))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}
        if body.get("stream"):
            return events(job, head, "text_completion", completion_chunks, body)
        text, lps, extra, final = "", [], {}, None
        async for item in job.items():
            if "text" in item:
                text += item["text"]
                lps += item.get("logprobs", [])
            elif "prompt_logprobs" in item:
                extra = item
            else:
                final = item
        if final is None:
            raise ApiError(503, "the reply was stopped")
        return JSONResponse(head | {"object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": logprobs_object(lps) if logprobs is not None else None,
             "finish_reason": final["finish_reason"]} | extra], "usage": final["usage"]})

    async def not_found(request, exc):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code="not_found" if exc.status_code == 404 else None).response()

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions", handled(chat_completions), methods=["POST"]),
                             Route("/v1/completions", handled(completions), methods=["POST"])],
                     exception_handlers={HTTPException: not_found})


def logprobs_object(lps, offset=0):  # [(token text, logprob, top)] -> OpenAI's completions logprobs
    offsets = []
    for text, _, _ in lps:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [t for t, _, _ in lps], "token_logprobs": [lp for _, lp, _ in lps],
            "top_logprobs": [top for _, _, top in lps], "text_offset": offsets}


def chat_chunks(item, first):  # a job's item -> the choices of its chat.completion.chunk
    if "delta" in item:
        return [{"index": 0, "delta": ({"role": "assistant"} if first else {}) | item["delta"], "logprobs": None,
                 "finish_reason": None}]
    return [{"index": 0, "delta": {"role": "assistant"} if first else {}, "logprobs": None,
             "finish_reason": item["finish_reason"]}]


def completion_chunks(item, first):  # a job's item -> the choices of its text_completion chunk
    if "text" in item:
        lps = item.get("logprobs")
        return [{"index": 0, "text": item["text"], "logprobs": None if lps is None else logprobs_object(lps),
                 "finish_reason": None}]
    if "prompt_logprobs" in item:
        return [{"index": 0, "text": "", "logprobs": None, "finish_reason": None} | item]
    return [{"index": 0, "text": "", "logprobs": None, "finish_reason": item["finish_reason"]}]


def events(job, head, kind, choices_of, body):
    """The job as server-sent events: a chunk per item, the usage chunk when stream_options asks, then
    [DONE]. An error after the stream began comes as an error object, then the stream ends."""
    with_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    async def lines():
        first = True
        try:
            async for item in job.items():
                chunk = head | {"object": kind, "choices": choices_of(item, first)}
                first = False
                if with_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                if "usage" in item and with_usage:
                    yield f"data: {json.dumps(head | {'object': kind, 'choices': [], 'usage': item['usage']})}\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -----------------------------------------------------------------------------
# The command line

def bind(host, port):  # a listening socket on host:port (port 0: a free one) -> (socket, the URL of its API)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family)
    port = sock.getsockname()[1]
    return sock, f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}/v1"


async def serve(engine, sock, url, max_body_bytes):  # until SIGINT / SIGTERM; the URL line once serving
    config = uvicorn.Config(app(engine, max_body_bytes), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not (server.started or task.done()):
        await asyncio.sleep(0.02)
    if server.started:
        print(f"serving {engine.name} at {url} (OpenAI API; Ctrl-C stops)", flush=True)
    while not (server.should_exit or task.done()):
        await asyncio.sleep(0.05)
    engine.stopping.set()                                        # replies in progress end at their next token
    await task


def stop_quietly(signum, frame):  # SIGINT / SIGTERM outside uvicorn's own handling: exit 0
    raise SystemExit(0)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 stopped by SIGINT or SIGTERM; 2 bad input (flags, files, checkpoint, the port), "
               "reported on one line 'error: ...' (--debug: the traceback).")
    generate.add_model_flags(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, named when ready)")
    ap.add_argument("--model-name", default=None, help="the model's name in the API (default: the checkpoint's folder)")
    ap.add_argument("--max-queue", type=int, default=16,
                    help="requests that may wait behind the one running; more are refused with 429 (default 16)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20,
                    help="a request body over this is refused with 413 before it is read whole (default 1 MiB)")
    ap.add_argument("--debug", action="store_true", help="on an error, show the Python traceback, not one line")
    a = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_quietly)
    engine = None
    try:
        if not 0 <= a.port <= 65535:
            raise ValueError(f"--port {a.port}: must be in [0, 65535]")
        for flag, value in (("--max-queue", a.max_queue), ("--max-body-bytes", a.max_body_bytes),
                            ("--max-seq-len", 1 if a.max_seq_len is None else a.max_seq_len)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")
        if not Path(a.ckpt).is_dir():
            raise FileNotFoundError(f"--ckpt {a.ckpt}: no such folder")
        a.parallel = None
        generate.set_device(a)
        tok = generate.load_tokenizer(a.ckpt)
        fmt = a.chat_format or chat.default_format(a.ckpt)
        generate.context_of(a.ckpt, a.max_seq_len, a.experts)  # config.json checked before the weights load
        sock, url = bind(a.host, a.port)
        engine = Engine(generate.load_model(a), tok, fmt, a.model_name or Path(a.ckpt).resolve().name, a.max_queue)
        asyncio.run(serve(engine, sock, url, a.max_body_bytes))
    except generate.USER_ERRORS as e:
        if a.debug:
            raise
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
