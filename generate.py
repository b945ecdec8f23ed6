"""Generate text from a DeepSeek-V3.2-Exp or V4-Flash checkpoint (real layout, or the bundled tiny ones).

    python generate.py --ckpt DIR --prompt "Hello"            one prompt, streamed
    python generate.py --ckpt DIR --input-file prompts.txt    prompts split on blank lines, one batch
    python generate.py --ckpt DIR --interactive               a chat (commands below)
    python generate.py --ckpt DIR --interactive --thinking --tools tools.json   reasoning shown apart,
                                                              tool calls printed, their results asked for
    python generate.py --ckpt DIR --prompt "Hi" --temperature 0.7 --top-p 0.9 --top-k 50 \\
        --repetition-penalty 1.1 --stop "\\n\\n" --seed 3     sampling controls (--stop repeatable)
    python generate.py --ckpt DIR --verify [--record-golden FILE]   the backend against the NumPy reference
    torchrun --nproc-per-node 8 generate.py --ckpt DIR ...    tensor/expert parallel over 8 GPUs
                                                              (parallel.py); rank 0 reads and prints

The chat: /help lists the commands, /clear forgets the conversation, /exit quits (so do Ctrl-D and two
Ctrl-C in a row at the prompt, exit status 130); an empty line is ignored. Ctrl-C during a reply stops
it ("[stopped]") and drops that exchange (the user's line and the partial reply) from the conversation.

From Python (the repository folder on sys.path; see complete() and stream()):

    import sys; sys.path.insert(0, "/path/to/dsa-ref")
    import generate
    from model import Transformer
    model = Transformer.from_pretrained("/path/to/dsa-ref/tiny-v32")
    tok = generate.load_tokenizer("/path/to/dsa-ref/tiny-v32")
    text = generate.complete(model, tok, "Once upon a time", 20, temperature=0.7, seed=1)
    reply = generate.complete(model, tok, [{"role": "user", "content": "Hi"}], 20)   # dict: content, ...
    for piece in generate.stream(model, tok, "Once upon a time", 20):
        print(piece, end="", flush=True)

The loop is the official demo's (spec/dsv32.md §6): prefill the shortest prompt, then one token at a
time, longer prompts teacher-forced; sampling is argmax(softmax(logits / T) / Exp(1)), an exact
categorical draw, over the tokens top-k and top-p leave; temperature 0 is greedy. Each row of a batch
has its own sampling options and its own random generator, so its tokens do not depend on its
neighbours. Unlike the demo, a chat turn reuses the cached conversation and prefills only the new
tokens (a prefill chunk at start_pos > 0).
"""
import argparse
import dataclasses
import json
import math
import numbers
import os
import re
import sys
import time
from pathlib import Path

import progress

with progress.needs_setup("generate.py", active=__name__ == "__main__"):   # python3 outside .venv: one line
    import numpy as np

    import chat
    import checkpoint
    from checkpoint import CheckpointError
    from model import LoadError, Transformer

# what bad input raises: main prints it as one line, "error: ...", exit status 2 (--debug: the traceback)
USER_ERRORS = (ValueError, OSError, LoadError)


def load_tokenizer(ckpt):  # tokenizer.json; tokenizer_config.json checked for chat.default_format
    from tokenizers import Tokenizer
    path = Path(ckpt) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: this checkpoint has no tokenizer, so text cannot be encoded")
    config = path.with_name("tokenizer_config.json")
    if config.is_file() and not isinstance(checkpoint.read_json(config), dict):
        raise CheckpointError(f"{config}: expected a JSON object")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                               # tokenizers raises a bare Exception
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read "
                              f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None


# -----------------------------------------------------------------------------
# Sampling: one row's options, checked when made

def check_temperature(temperature, name="temperature"):  # NaN would pick token 0 forever, -1 be greedy silently
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name} {temperature}: must be a finite number >= 0 (0 is greedy)")


def check_sampling(values, flags=False):  # field -> value; a bad one is a ValueError naming it (as its flag)
    def name(field):
        return "--" + field.replace("_", "-") if flags else field
    check_temperature(values["temperature"], name("temperature"))
    k, p, r = values["top_k"], values["top_p"], values["repetition_penalty"]
    if k is not None and not (isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"{name('top_k')} {k}: must be an integer >= 1")
    if not (isinstance(p, numbers.Real) and 0 < p <= 1):
        raise ValueError(f"{name('top_p')} {p}: must be in (0, 1]")
    if not (isinstance(r, numbers.Real) and math.isfinite(r) and r > 0):
        raise ValueError(f"{name('repetition_penalty')} {r}: must be a finite number > 0 (1 is off)")
    for s in values["stop"]:
        if not (isinstance(s, str) and s):
            raise ValueError(f"{name('stop')} {s!r}: a stop string must be a non-empty string")
    seed = values["seed"]
    if not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and seed >= 0):
        raise ValueError(f"{name('seed')} {seed}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one row draws its tokens, in this order: the repetition penalty on the logits, the
    temperature, top-k, top-p, then an exact categorical draw (sample). Temperature 0 is greedy (the
    penalty still applies; top-k, top-p and the seed then change nothing)."""
    temperature: float = 0.0
    top_k: int | None = None           # keep the k most likely tokens (ties with the k-th too); None: all
    top_p: float = 1.0                 # then the most likely tokens until their probability reaches top_p
    repetition_penalty: float = 1.0    # CTRL's: a token of the prompt or output so far has its logit / r if > 0, * r if not
    stop: tuple = ()                   # strings: the text ends before the first one (generate needs tok=)
    seed: int = 0                      # the row's own generator: np.random.default_rng(seed)

    def __post_init__(self):
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        check_sampling(dataclasses.asdict(self))


def sample(logits, temperature, rng):  # [B, V] f32 -> [B] int
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits / max(temperature, 1e-5)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p / rng.exponential(size=p.shape)).argmax(-1)          # exponential race = categorical


def penalize(logits, seen, penalty):  # [V] f32, token ids so far -> the logits with CTRL's repetition penalty
    if penalty == 1:
        return logits
    logits, seen = logits.copy(), np.unique(seen)
    x = logits[seen]
    logits[seen] = np.where(x > 0, x / penalty, x * penalty)
    return logits


def keep_top(logits, temperature, top_k=None, top_p=1.0):  # [V] f32 -> the logits with the tokens cut set to -inf
    z = logits / max(temperature, 1e-5)
    keep = np.ones(len(z), bool)
    if top_k is not None and top_k < len(z):
        keep = z >= np.partition(z, -top_k)[-top_k]                 # ties with the k-th stay
    if top_p < 1:
        p = np.where(keep, np.exp(z.astype(np.float64) - z.max()), 0)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]                    # the mass of the more likely tokens
        keep = np.zeros(len(z), bool)
        keep[order[before < top_p * p.sum()]] = True               # until the kept mass reaches top_p
    return np.where(keep, logits, -np.inf).astype(logits.dtype)


def draw(logits, s, rng, seen):  # one row: [V] logits, its Sampling, its generator, its tokens so far -> a token id
    logits = penalize(logits, seen, s.repetition_penalty)
    if s.temperature > 0 and (s.top_k is not None or s.top_p < 1):
        logits = keep_top(logits, s.temperature, s.top_k, s.top_p)
    return int(sample(logits[None], s.temperature, rng)[0])


class TextRow:
    """One row's completion as text: token ids in, new text out, ended before the first stop string
    (cut, with whatever follows it); a tail that could still begin a stop string is held back until
    the next token decides it, so streamed text never shows any of a stop string."""

    def __init__(self, tok, stop=()):
        self.detok, self.stop, self.held, self.stopped = chat.Detokenizer(tok), stop, "", False
        self.text = ""                                   # all of it so far

    def feed(self, token_id):  # -> the text that is now sure to be part of the output
        return self._scan(self.detok.feed(token_id), final=False)

    def finish(self):  # -> what was held back (at the end nothing more can complete a stop string)
        return "" if self.stopped else self._scan(self.detok.flush(), final=True)

    def _scan(self, piece, final):
        text = self.held + piece
        hits = [i for i in map(text.find, self.stop) if i >= 0]
        if hits:
            self.stopped, self.held, out = True, "", text[:min(hits)]
        else:
            hold = 0 if final else chat.held_suffix(text, 0, self.stop)
            self.held, out = text[len(text) - hold:], text[:len(text) - hold]
        self.text += out
        return out


def _on_cuda(model):  # a torch model on a CUDA GPU in official numerics: its decode step is capturable
    opts = getattr(model, "opts", model)                          # V3.2 keeps its options in .opts, V4 on itself
    ops = getattr(opts, "ops", None)
    return ops is not None and ops.name == "torch" and ops.device.type == "cuda" and opts.official and \
        (opts is not model or ops.v4_attention_step is not None)   # V4: its step needs the V4 kernels


def check_room(longest, max_new_tokens, max_seq_len):  # a prompt of `longest` tokens and the reply fit the context
    total = longest + max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"max_seq_len {max_seq_len}; shorten the prompt or raise --max-seq-len")


def rows_of(sampling, B, rng, options):  # generate's sampling arguments -> (a Sampling per row, a generator per row)
    if sampling is None:
        sampling = Sampling(**options)
    elif options:
        raise ValueError(f"give either sampling= or its fields ({', '.join(options)}), not both")
    rows = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * B
    if len(rows) != B or not all(isinstance(s, Sampling) for s in rows):
        raise ValueError(f"sampling: a Sampling, or a list of {B} (one per row)")
    rngs = [np.random.default_rng(s.seed) for s in rows] if rng is None else \
        (list(rng) if isinstance(rng, (list, tuple)) else [rng])
    if len(rngs) != B:
        raise ValueError(f"rng: a generator per row ({B}), got {len(rngs)}")
    return rows, rngs


def generate_steps(model, prompts, max_new_tokens, eos_id, sampling=None, reuse=0, cuda_graph=True, rng=None,
                   tok=None, **options):
    """generate() as a Python generator: yields (token id, text piece) for each token row 0 generates
    (the piece "" without tok=), and returns (completions, stats) (StopIteration's value)."""
    B = len(prompts)
    rows, rngs = rows_of(sampling, B, rng, options)
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("an empty prompt cannot be generated from")
    if tok is None and any(s.stop for s in rows):
        raise ValueError("stop strings are matched on the text: give the tokenizer (tok=)")
    check_room(max(lens), max_new_tokens, model.args.max_seq_len)
    total = max(lens) + max_new_tokens
    model.reserve(B, total)                                          # caches allocated once, up front
    tokens = np.full((B, total), -1, np.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    is_prompt = tokens >= 0
    texts = [TextRow(tok, s.stop) for s in rows] if tok is not None else None
    finished, n_out, reason = np.zeros(B, bool), np.zeros(B, int), ["length"] * B
    greedy = all(s.temperature <= 0 and s.repetition_penalty == 1 for s in rows)
    stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0, "decode_steps": 0, "rows": B}
    prev = reuse
    graph, use_graph = None, cuda_graph and _on_cuda(model)
    for cur in range(min(lens), total):
        t0 = time.perf_counter()
        if use_graph and cur - prev == 1 and prev > reuse:               # decode: replay one captured graph
            if graph is None:
                import backend_torch
                graph = backend_torch.GraphDecoder(model, B, prev)
            logits = graph(tokens[:, prev:cur], prev)
        else:
            logits = model.forward(tokens[:, prev:cur], start_pos=prev)
        live = ~is_prompt[:, cur] & ~finished                           # the rows that draw a token here
        if not isinstance(logits, np.ndarray) and greedy:              # torch, greedy: only the tokens come back
            nxt = logits.argmax(-1).cpu().numpy()
        else:
            if not isinstance(logits, np.ndarray):
                logits = logits.float().cpu().numpy()
            nxt = logits.argmax(-1)                                     # (what finished rows feed: any valid id)
            for i in np.flatnonzero(live):                             # each row with its own options and generator
                nxt[i] = draw(logits[i], rows[i], rngs[i], tokens[i, :cur])
        nxt = np.where(is_prompt[:, cur], tokens[:, cur], nxt)         # teacher-force longer prompts
        tokens[:, cur] = nxt
        kind = "prefill" if prev == reuse else "decode"
        stats[kind + "_tokens"] += B * (cur - prev)
        stats[kind + "_s"] += time.perf_counter() - t0
        stats["decode_steps"] += kind == "decode"
        prev = cur
        for i in np.flatnonzero(live):
            if nxt[i] == eos_id:
                finished[i], reason[i] = True, "stop"
                continue
            n_out[i] += 1
            piece = texts[i].feed(nxt[i]) if texts else ""
            if i == 0:
                yield int(nxt[0]), piece
            if texts and texts[i].stopped:
                finished[i], reason[i] = True, "stop"
            elif n_out[i] == max_new_tokens:
                finished[i] = True
        if finished.all():
            break
    for i, t in enumerate(texts or ()):                                # the held tail, now decided
        piece = t.finish()
        if i == 0 and piece:
            yield None, piece
    out = [tokens[i, n:n + k].tolist() for i, (n, k) in enumerate(zip(lens, n_out))]
    stats["cached"] = tokens[0, :prev].tolist() if B == 1 else None   # what the caches hold now
    stats["finish_reason"] = reason                                     # per row: "stop" (EOS, a stop string) or "length"
    stats["new_tokens"] = n_out.tolist()                                # per row: its completion's length
    stats["text"] = [t.text for t in texts] if texts else None         # per row, cut before a stop string
    return out, stats


def generate(model, prompts, max_new_tokens, eos_id, sampling=None, on_token=None, reuse=0, cuda_graph=True,
             rng=None, tok=None, on_text=None, **options):
    """prompts: lists of token ids -> (completions, stats). sampling: a Sampling for every row, or a list
    of one per row; or its fields as keyword arguments (temperature=0.7, top_p=0.9, ...; default
    greedy). Each row draws from its own generator, np.random.default_rng(its seed), unless rng gives
    them (a generator per row, or one for a batch of one: a chat goes on with its stream). A row ends
    at EOS (not in its completion), at a stop string (tok= needed: the text is matched; the token that
    completed it stays in the completion, stats["text"] is cut before it) or after max_new_tokens.
    on_token(id) and on_text(piece) see row 0's tokens and text as they come (on_text needs tok=).
    reuse > 0 (batch of one): the model's caches already hold prompts[0][:reuse], so only the rest
    is prefilled (a chunk at start_pos=reuse). On a CUDA device the decode steps replay one captured
    CUDA graph (cuda_graph=False: plain steps). stats: the token counts and times (the tokens fed to the
    model: "decode_tokens" counts every row of each of the "decode_steps"), "new_tokens", "finish_reason"
    and "text" per row, and "cached" (batch of one: the token ids the caches hold now)."""
    steps = generate_steps(model, prompts, max_new_tokens, eos_id, sampling, reuse, cuda_graph, rng, tok, **options)
    while True:
        try:
            token, piece = next(steps)
        except StopIteration as end:
            return end.value
        if on_token is not None and token is not None:
            on_token(token)
        if on_text is not None and piece:
            on_text(piece)


# -----------------------------------------------------------------------------
# Chat output: the parsed reply as it streams

class ChatStream:
    """Completion text in (any pieces), the chat reply out as items: ("reasoning", text),
    ("content", text), ("tool_call", {"name", "arguments"}) once a call is complete, and
    ("error", {"reason", "text"}) for malformed output. finish() -> the items left and the reply
    {"reasoning", "content", "tool_calls", "finish_reason", "errors"} as chat.parse gives them."""

    def __init__(self, fmt, prompt, tools=None):
        self.parser = chat.StreamParser(fmt, prompt, tools)
        self.names, self.text = {}, {"reasoning": "", "content": ""}

    def feed(self, piece):  # -> [item]
        return self._items(self.parser.feed(piece))

    def finish(self):  # -> ([item], reply)
        items, p = self._items(self.parser.finish()), self.parser
        return items, {"reasoning": self.text["reasoning"] or None, "content": self.text["content"] or None,
                       "tool_calls": p.calls, "finish_reason": p.finish_reason, "errors": p.errors}

    def _items(self, events):
        items = []
        for e in events:
            kind = e["type"]
            if kind in ("reasoning", "content") and e["text"]:
                self.text[kind] += e["text"]
                items.append((kind, e["text"]))
            elif kind == "tool_call":
                self.names[e["index"]] = e["name"]
            elif kind == "tool_call_done":
                items.append(("tool_call", {"name": self.names[e["index"]], "arguments": json.loads(e["arguments"])}))
            elif kind == "error":
                items.append(("error", {"reason": e["reason"], "text": e["text"]}))
        return items


class ChatPrinter:
    """Completion text in, the parsed chat out as it streams: reasoning under a [reasoning] header, the
    answer under [answer] (headers only when there is reasoning), each tool call as one JSON line,
    malformed output noted on stderr."""

    def __init__(self, fmt, prompt, tools=None, out=sys.stdout, err=sys.stderr):
        self.stream, self.out, self.err, self.section = ChatStream(fmt, prompt, tools), out, err, None

    def text(self, piece):
        self._show(self.stream.feed(piece))

    def finish(self):  # -> the reply, as ChatStream.finish
        items, reply = self.stream.finish()
        self._show(items)
        return reply

    def _show(self, items):
        for kind, value in items:
            if kind in ("reasoning", "content"):
                if self.section != kind and (kind == "reasoning" or self.section == "reasoning"):
                    self.out.write(("\n" if self.section else "") + f"[{'reasoning' if kind == 'reasoning' else 'answer'}] ")
                self.section = kind
                self.out.write(value)
            elif kind == "tool_call":
                self.out.write("\n[tool call] " + json.dumps(value, ensure_ascii=False) + "\n")
            else:
                self.err.write(f"\n[malformed model output: {value['reason']}] {value['text']!r}\n")
        self.out.flush()


# -----------------------------------------------------------------------------
# The Python API for text: a loaded model, its tokenizer, and a prompt or chat messages

def stream(model, tok, prompt, max_new_tokens=200, *, chat_format=None, thinking=False, tools=None, sampling=None,
           **options):
    """Yield the reply as it is decoded. prompt: text, fed as is (yields str pieces), or OpenAI-style
    chat messages [{"role": "user", "content": ...}, ...], rendered with chat.encode in chat_format
    (default: the checkpoint's, chat.default_format), with thinking and tools (an OpenAI tool list)
    (yields ChatStream's items: ("reasoning", text), ("content", text), ("tool_call", {"name",
    "arguments"}), ("error", {...})). sampling: a Sampling, or its fields as keyword arguments
    (temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, stop=["\\n\\n"], seed=1; default
    greedy). complete() returns what these pieces join to."""
    return (yield from _reply(model, tok, prompt, max_new_tokens, chat_format, thinking, tools, sampling, options))


def complete(model, tok, prompt, max_new_tokens=200, **kw):
    """The whole reply: for text, the completion text (str); for chat messages a dict {"reasoning",
    "content", "tool_calls", "finish_reason", "errors"} (reasoning and content None when empty;
    finish_reason "tool_calls", "stop" (EOS or a stop string) or "length"). Arguments as stream()."""
    steps = stream(model, tok, prompt, max_new_tokens, **kw)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def _reply(model, tok, prompt, max_new_tokens, chat_format, thinking, tools, sampling, options):
    if isinstance(prompt, str):
        text, parsed = prompt, None
    else:
        chat_format = chat_format or chat.default_format(model.path)
        text = chat.encode(list(prompt), fmt=chat_format, thinking=thinking, tools=tools)
        parsed = ChatStream(chat_format, text, tools)
    ids = tok.encode(text, add_special_tokens=False).ids
    steps = generate_steps(model, [ids], max_new_tokens, model.args.eos_token_id, sampling, tok=tok, **options)
    while True:
        try:
            _, piece = next(steps)
        except StopIteration as end:
            _, stats = end.value
            break
        if piece:
            yield from (piece,) if parsed is None else parsed.feed(piece)
    if parsed is None:
        return stats["text"][0]
    items, reply = parsed.finish()
    yield from items
    if reply["finish_reason"] != "tool_calls":
        reply["finish_reason"] = stats["finish_reason"][0]
    return reply


def show_progress(i, n, err=sys.stderr):  # loading: one line redrawn per layer
    bar = "#" * (30 * i // n)
    err.write(f"\rloading layers [{bar:<30}] {i}/{n}" + ("\n" if i == n else ""))
    err.flush()


def report(stats, err=sys.stderr):
    """The speeds count the tokens fed to the model: a batch's decode step feeds every row (a row past its
    end too, a longer prompt's tokens teacher-forced); the new tokens are the completions' (EOS not counted)."""
    def rate(n, s):
        return f"{n / s:.1f} tok/s" if s > 0 else "n/a"
    B, steps, new = stats["rows"], stats["decode_steps"], stats["new_tokens"]
    fed = f"{steps} steps x {B} rows = " if B > 1 else ""
    print(f"\nprefill: {stats['prefill_tokens']} tokens in {stats['prefill_s']:.2f} s ({rate(stats['prefill_tokens'], stats['prefill_s'])}); "
          f"decode: {fed}{stats['decode_tokens']} tokens in {stats['decode_s']:.2f} s ({rate(stats['decode_tokens'], stats['decode_s'])}); "
          f"{sum(new)} new tokens" + (f" ({B} prompts, {min(new)}{'' if min(new) == max(new) else f' to {max(new)}'} each)"
                                      if B > 1 else ""), file=err)


def load_tools(path):  # an OpenAI-style JSON tool list, in the shape chat.py's tool blocks read
    """[{"type": "function", "function": {"name": str, "description"?: str, "parameters"?: object}}, ...],
    or the bare function objects; anything else is a ValueError naming the file and the tool."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise (IsADirectoryError(f"--tools {p}: a folder, not a JSON file of tools") if p.is_dir() else
               FileNotFoundError(f"--tools {p}: no such file"))
    try:
        tools = checkpoint.read_json(p)
    except CheckpointError as e:
        raise ValueError(f"--tools {e}") from None
    return check_tools(tools, f"--tools {p}")


def check_tools(tools, name):  # an OpenAI tool list, however it came -> itself; else a ValueError starting with name
    if not isinstance(tools, list):
        raise ValueError(f"{name}: expected a JSON list of tools, each with a function name; "
                         f"got {checkpoint.json_type(tools)}")
    for i, t in enumerate(tools):
        where = f"{name}: tool {i}"
        if not isinstance(t, dict):
            raise ValueError(f"{where}: expected an object, got {checkpoint.json_type(t)}")
        if "function" in t and t.get("type", "function") != "function":
            raise ValueError(f"{where}: type {t['type']!r} is not \"function\"")
        f = t.get("function", t)
        if not isinstance(f, dict):
            raise ValueError(f"{where}: \"function\" must be an object, got {checkpoint.json_type(f)}")
        if not (isinstance(f.get("name"), str) and f["name"]):
            raise ValueError(f"{where}: name must be a non-empty string, got {checkpoint.json_type(f.get('name'))}")
        if not isinstance(f.get("description", ""), (str, type(None))):    # null: no description line
            raise ValueError(f"{where} ({f['name']}): description must be a string, "
                             f"got {checkpoint.json_type(f['description'])}")
        if not isinstance(f.get("parameters", {}), dict):
            raise ValueError(f"{where} ({f['name']}): parameters must be an object (a JSON schema), "
                             f"got {checkpoint.json_type(f['parameters'])}")
    return tools


def resolve_device(backend, device):  # --backend and --device -> the torch device string (None for NumPy)
    if device is not None:
        checkpoint.check_device(device, gpus=False)                      # its form first, torch or not
    if backend == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"--device {device} needs --backend torch (the NumPy reference runs on the CPU)")
        return device
    try:
        return checkpoint.check_device(device)                           # caught here, not as a traceback later
    except ImportError:
        raise ValueError("--backend torch needs PyTorch, which is not installed here: ./setup.sh --torch installs it "
                         "(the CPU build, pinned; ./setup.sh --tests has it too)") from None


def user_turn(tok, text, a):  # one user turn (or the raw text) -> (prompt text, token ids)
    prompt = text if a.raw else chat.encode([{"role": "user", "content": text}], fmt=a.chat_format,
                                            thinking=a.thinking, tools=a.tool_list)
    return prompt, tok.encode(prompt, add_special_tokens=False).ids


def context_of(ckpt, max_seq_len, experts=None):  # config.json read and checked (no weights) -> this run's max_seq_len
    from config import ModelArgs, V4Args
    cfg = checkpoint.Checkpoint(ckpt).config
    v4 = cfg.get("model_type") == "deepseek_v4"
    if experts is not None and not v4:
        raise ValueError(f"--experts {experts}: an option of DeepSeek-V4 checkpoints; this one's experts are FP8 "
                         "as stored")
    args = V4Args if v4 else ModelArgs
    return args.from_config(cfg, where=str(Path(ckpt) / "config.json"),
                            **({"max_seq_len": max_seq_len} if max_seq_len is not None else {})).max_seq_len


def read_prompts(path):  # --input-file: prompts separated by blank lines
    path = Path(path)
    if not path.is_file():
        raise (IsADirectoryError(f"--input-file {path}: a folder, not a text file of prompts") if path.is_dir() else
               FileNotFoundError(f"--input-file {path}: no such file"))
    try:
        texts = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    except UnicodeDecodeError as e:
        raise ValueError(f"--input-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not texts:
        raise ValueError(f"--input-file {path} holds no prompt")
    return texts


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 done; 2 bad input (flags, files, checkpoint), reported on one line 'error: ...' "
               "(--debug shows the traceback instead; argparse's own usage errors are 2 as well); 130 interrupted "
               "(Ctrl-C; in the chat: twice in a row at the prompt, once during a reply stops the reply); "
               "with --verify: 0 pass, 1 fail, 3 nothing compared.")
    add_model_flags(ap)                                # --ckpt, --chat-format and the loading flags
    src = ap.add_mutually_exclusive_group()            # one of them required: checked after parsing (below)
    src.add_argument("--prompt", help="one prompt (a single user turn unless --raw)")
    src.add_argument("--input-file", help="a text file of prompts separated by blank lines, generated as one batch")
    src.add_argument("--interactive", action="store_true",
                     help="chat on stdin; /help lists the commands, /clear resets the conversation, /exit quits")
    src.add_argument("--verify", action="store_true",
                     help="check the chosen backend against the NumPy reference and the recorded goldens, then exit")
    ap.add_argument("--raw", action="store_true",
                    help="feed the prompt text as is, without the chat format (--prompt, --input-file)")
    ap.add_argument("--thinking", action="store_true", help="thinking mode: the model reasons first; shown apart")
    ap.add_argument("--tools", default=None, help="an OpenAI-style JSON tool list, described in the system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 is greedy (default 0.6)")
    ap.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only (default: all)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="then among the most likely tokens whose probability reaches p, in (0, 1] (default 1: all)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="CTRL's: the logit of a token already in the prompt or output is divided by this if "
                         "positive, multiplied if negative; > 0 (default 1: off)")
    ap.add_argument("--stop", action="append", default=[], metavar="STRING",
                    help="end the output before this string (cut from it); repeatable")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampler's random numbers (default 0)")
    ap.add_argument("--verify-layers", type=int, default=None,
                    help="--verify: compare only the first N layers (for checkpoints too large for the CPU reference)")
    ap.add_argument("--record-golden", default=None, metavar="FILE",
                    help="--verify: record this combination's golden outputs into FILE (not the tracked goldens.json, "
                         "which --verify only reads)")
    ap.add_argument("--debug", action="store_true", help="on an error, show the Python traceback, not one line")
    a = ap.parse_args(argv)
    if not (a.prompt is not None or a.input_file is not None or a.interactive or a.verify or
            a.verify_layers is not None or a.record_golden is not None):   # those two: check_flags says "needs --verify"
        ap.error("one of the arguments --prompt --input-file --interactive --verify is required")
    try:
        with progress.needs_setup("generate.py"):       # a package imported as it is needed (tokenizers)
            run(a)
    except KeyboardInterrupt:                             # Ctrl-C while loading, generating or at the prompt
        if a.debug:
            raise
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except USER_ERRORS as e:
        if a.debug:
            raise
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        raise SystemExit(2) from None


def add_model_flags(ap):  # the checkpoint and how it loads: generate.py's flags, serve.py's too
    ap.add_argument("--ckpt", required=True, help="checkpoint folder: config.json, safetensors shards + index, tokenizer.json")
    ap.add_argument("--chat-format", choices=chat.FORMATS, default=None,
                    help="v32exp (V3.1/V3.2-Exp template), dsml32 (V3.2), dsml4 (V4); default: from the checkpoint "
                         "(its tokenizer_config.json chat_template, else its model_type)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"],
                    help="numpy: the reference path (default); torch: the fast path (CPU or GPU)")
    ap.add_argument("--device", default=None,
                    help="torch device: cpu, cuda, cuda:1 ... (default: cuda when there is a GPU, else cpu)")
    ap.add_argument("--numerics", default="official", choices=["official", "exact"],
                    help="official: the official model's bf16/FP8 rounding (default); exact: float32 throughout")
    ap.add_argument("--attention", default="sparse", choices=["sparse", "dense"],
                    help="sparse: DSA top-k selection (default); dense: every causal key (V3.1-Terminus behaviour)")
    ap.add_argument("--indexer", default=None, choices=["fp8", "exact"],
                    help="indexer precision (default: fp8 with official numerics, exact with exact numerics)")
    ap.add_argument("--experts", default=None, choices=["fp4", "fp8"],
                    help="DeepSeek-V4's routed experts: fp4 as stored (default), or re-encoded at load to 128x128 "
                         "block FP8 (exact, twice the memory: the FP8 GEMMs)")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="context length for caches and YaRN (default: the config's max_position_embeddings)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch on the CPU: intra-op threads (default 1: a decode step's ops are too small to split, "
                         "and threads that wait for each other on a busy machine made it 10x slower)")


def check_flags(a):  # what the flags alone can refuse (before any file is read)
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens}: must be at least 1")
    if a.max_seq_len is not None and a.max_seq_len < 1:
        raise ValueError(f"--max-seq-len {a.max_seq_len}: must be positive")
    fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(Sampling)}
    check_sampling(fields, flags=True)
    a.sampling = Sampling(**fields)
    if not a.verify and (a.verify_layers is not None or a.record_golden is not None):
        raise ValueError(f"{'--verify-layers' if a.verify_layers is not None else '--record-golden'} needs --verify")
    chat_only = [f for f, on in (("--tools", a.tools), ("--thinking", a.thinking), ("--interactive", a.interactive),
                                 ("--chat-format", a.chat_format)) if on]
    if a.raw and chat_only:                                              # each would be silently ignored
        raise ValueError(f"--raw feeds the text as is, so {chat_only[0]} (which "
                         f"{'chooses' if chat_only[0] == '--chat-format' else 'needs'} the chat format) cannot go with it")
    if a.verify and a.experts is not None:                               # verify() loads the experts as stored
        raise ValueError(f"--experts {a.experts} cannot go with --verify, which checks the experts as stored")
    if a.record_golden is not None:                                      # before the model loads, not after
        import verify
        verify.check_record(a.record_golden)


def run(a):  # main's work once the flags are parsed; bad input raises one of USER_ERRORS
    check_flags(a)
    if not Path(a.ckpt).is_dir():
        raise FileNotFoundError(f"--ckpt {a.ckpt}: no such folder")
    a.parallel = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:       # launched by torchrun: one rank of the parallel model
        if a.verify:
            raise ValueError("--verify runs in one process (not under torchrun)")
        import parallel
        a.parallel, a.device = parallel.init_from_env(a.device)   # a GPU per rank, or --device cpu: gloo
        a.backend = "torch"
        if a.parallel.rank != 0:                          # rank 0 prints and reads; the others compute
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
    set_device(a)
    if a.verify:
        import verify
        record = None if a.record_golden is None else Path(a.record_golden)   # where to write the golden
        raise SystemExit(verify.verify(a.ckpt, a.backend, a.device, a.numerics, a.verify_layers,
                                       record=record))   # 0 PASS, 1 FAIL, 3 nothing compared
    # everything the files can refuse, before the weights load
    a.tool_list = load_tools(a.tools)
    tok = load_tokenizer(a.ckpt)                          # first: it checks what default_format reads
    a.chat_format = a.chat_format or chat.default_format(a.ckpt)
    context = context_of(a.ckpt, a.max_seq_len, a.experts)
    texts = [a.prompt] if a.prompt is not None else read_prompts(a.input_file) if a.input_file is not None else None
    turns = [user_turn(tok, t, a) for t in texts] if texts else None
    if turns:
        check_room(max(len(ids) for _, ids in turns), a.max_new_tokens, context)
    elif a.max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens} leaves no room for a prompt in max_seq_len {context}")

    model = load_model(a)
    args, s = model.args, a.sampling
    print(f"ckpt={a.ckpt} backend={a.backend} numerics={model.numerics} attention={model.attention} "
          f"indexer={model.indexer} device={a.device or 'cpu'} max_seq_len={args.max_seq_len} yarn={'on' if args.yarn_active else 'off'} "
          f"index_topk={args.index_topk} chat_format={'raw' if a.raw else a.chat_format} thinking={a.thinking} "
          f"tools={len(a.tool_list or [])} temperature={s.temperature} top_k={s.top_k} top_p={s.top_p} "
          f"repetition_penalty={s.repetition_penalty} seed={s.seed} max_new_tokens={a.max_new_tokens}"
          + (f" stop={list(s.stop)}" if s.stop else "") + (f" ranks={a.parallel.world}" if a.parallel else ""),
          file=sys.stderr)
    eos = args.eos_token_id

    try:
        if a.prompt is not None:
            (prompt, ids), = turns
            printer = ChatPrinter("v32exp" if a.raw else a.chat_format, "" if a.raw else prompt, a.tool_list)
            out, stats = generate(model, [ids], a.max_new_tokens, eos, s, tok=tok, on_text=printer.text)
            printer.finish()
            print()
            report(stats)
        elif a.input_file is not None:
            print(f"generating {len(texts)} prompts as one batch", file=sys.stderr)
            out, stats = generate(model, [ids for _, ids in turns], a.max_new_tokens, eos, s, tok=tok)
            for t, (prompt, _), text in zip(texts, turns, stats["text"]):
                if a.raw:
                    print(f"Prompt: {t}\nCompletion: {text}\n")
                    continue
                r = chat.parse(text, a.chat_format, prompt, a.tool_list)
                print(f"Prompt: {t}")
                if r["reasoning"] is not None:
                    print(f"Reasoning: {r['reasoning']}")
                print(f"Completion: {r['content'] or ''}")
                for call in r["tool_calls"]:
                    print("Tool call: " + json.dumps(call, ensure_ascii=False))
                print()
            report(stats)
        else:
            print("chat: type a message; /help lists the commands, /exit or Ctrl-D quits", file=sys.stderr)
            interactive(model, tok, a, np.random.default_rng(s.seed), eos,
                        read=input if a.parallel is None else shared_input, stoppable=a.parallel is None)
    finally:
        if a.parallel is not None:
            import torch.distributed as dist
            dist.destroy_process_group()


def set_device(a):  # --backend, --device, --threads checked (a.device resolved); torch's CPU threads set
    a.device = resolve_device(a.backend, a.device)
    if a.threads is not None and (a.threads < 1 or a.backend != "torch" or a.device != "cpu"):
        raise ValueError(f"--threads {a.threads}: must be >= 1, and applies to --backend torch --device cpu")
    if a.backend == "torch" and a.device == "cpu" and a.parallel is None:
        import torch
        torch.set_num_threads(a.threads or 1)


def load_model(a):  # the flags of add_model_flags (after set_device) -> the model, loading shown on stderr
    print(f"loading {a.ckpt} (memory-mapped; weights are read as layers use them)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model = Transformer.from_pretrained(a.ckpt, backend=a.backend, numerics=a.numerics, attention=a.attention,
                                        indexer=a.indexer, max_seq_len=a.max_seq_len, device=a.device,
                                        progress=show_progress, parallel=a.parallel, experts=a.experts)
    print(f"loaded {model.args.num_hidden_layers} layers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model


def shared_input(prompt):  # under torchrun: rank 0 reads a line, every rank receives it (EOF too)
    import torch.distributed as dist
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = input(prompt)
        except EOFError:
            pass
    dist.broadcast_object_list(box, 0)
    if box[0] is None:
        raise EOFError
    return box[0]


# -----------------------------------------------------------------------------
# The chat

CHAT_HELP = """/help   this list
/clear  forget the conversation and start over
/exit   quit (so do Ctrl-D, and Ctrl-C twice in a row at the prompt)
Ctrl-C during a reply stops it and drops that exchange (your line and the partial reply)."""


def interactive(model, tok, a, rng, eos, read=input, out=sys.stdout, stoppable=True):
    """A multi-turn chat. Each model turn reuses the cached conversation (only what the caches lack
    is prefilled); a tool call is printed and its result asked for, then the model goes on.
    stoppable: Ctrl-C stops a reply, or at the prompt asks for a second one to quit (raised on);
    off under torchrun, where the ranks could not agree on where it came: any Ctrl-C ends the chat."""
    from types import SimpleNamespace
    state = SimpleNamespace(messages=[], cached=[])   # cached: the token ids the model's caches hold
    asked = False                                      # the last prompt ended in Ctrl-C
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            return
        except KeyboardInterrupt:
            if asked or not stoppable:
                raise
            asked = True
            print("\n(Ctrl-C again, /exit or Ctrl-D quits; /help lists the commands)", file=out, flush=True)
            continue
        asked, command = False, line.strip()
        if not command:
            continue
        if re.fullmatch(r"/\w+", command):            # a command, never sent to the model
            if command == "/exit":
                return
            if command == "/clear":
                state.messages, state.cached = [], []
                print("(conversation cleared)", file=out)
            else:
                print(CHAT_HELP if command == "/help" else f"unknown command {command} (/help lists the commands)", file=out)
            continue
        start = len(state.messages)
        state.messages.append({"role": "user", "content": line})
        try:
            if not exchange(model, tok, a, rng, eos, state, read, out):
                return
        except KeyboardInterrupt:
            if not stoppable:
                raise
            del state.messages[start:]
            print("\n[stopped]", file=out, flush=True)
        except ValueError as e:                        # the conversation outgrew the context
            del state.messages[start:]
            print("error: " + " ".join(str(e).splitlines()) + " (that exchange is dropped; /clear starts over)", file=out)


def exchange(model, tok, a, rng, eos, state, read, out):
    """Model turns until one answers without a tool call (their results read in between) -> False at EOF.
    state.cached always names what the caches surely hold, so a turn stopped midway leaves it right."""
    sampling = getattr(a, "sampling", None) or Sampling(temperature=a.temperature)   # (an `a` made by hand)
    while True:
        prompt = chat.encode(state.messages, fmt=a.chat_format, thinking=a.thinking, tools=a.tool_list)
        ids = tok.encode(prompt, add_special_tokens=False).ids
        cached, reuse = state.cached, 0              # the longest prefix already cached, one token left to feed
        while reuse < min(len(cached), len(ids) - 1) and cached[reuse] == ids[reuse]:
            reuse += 1
        if reuse < len(cached) and not model.can_rewind:   # V4: its caches hold no earlier positions
            reuse = 0
        # while this turn runs the caches surely hold only the reused prefix (V4, stopped midway: nothing usable)
        state.cached = ids[:reuse] if model.can_rewind else []
        printer = ChatPrinter(a.chat_format, prompt, a.tool_list, out=out)
        _, stats = generate(model, [ids], a.max_new_tokens, eos, sampling, reuse=reuse, rng=rng, tok=tok,
                            on_text=printer.text)
        state.cached = stats["cached"]
        r = printer.finish()
        print(file=out)
        report(stats)
        reply = {"role": "assistant", "content": r["content"] or ""}
        if r["reasoning"]:
            reply["reasoning_content" if a.chat_format == "dsml32" else "reasoning"] = r["reasoning"]
        if r["tool_calls"]:
            reply["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                   for c in r["tool_calls"]]
        state.messages.append(reply)
        if not r["tool_calls"]:
            return True
        for c in r["tool_calls"]:
            try:
                result = read(f"result of {c['name']}> ")
            except EOFError:
                return False
            state.messages.append({"role": "tool", "content": result})


if __name__ == "__main__":
    main()
