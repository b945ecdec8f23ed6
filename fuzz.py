"""Coverage-guided fuzz targets for the readers of untrusted input (bad input never destroys,
crashes or lies), run by atheris (libFuzzer for Python):

    .venv/bin/pip install atheris==3.0.0
    .venv/bin/python fuzz.py --list
    .venv/bin/python fuzz.py dsml4 -runs=1000000 [-artifact_prefix=DIR/] [CORPUS_DIR ...]

Each run starts from seeds built here (spec/chat.md's examples, files our writer wrote, the tiny
config) and a dictionary of the format's markers, written to a temporary folder placed after any
corpus folders given (so new inputs land in the first of those). -rss_limit_mb=2048 -timeout=10 are
the defaults. A crash is an exception a target lets out; libFuzzer saves its input as crash-<sha1>.

    header  checkpoint.read_header on the bytes after the first as a file, or (first byte odd) on a
            file of tensors with fields set to JSON values drawn from them: returns or raises
            CheckpointError, and what it returns holds: offsets in the file, sizes fit dtype and shape
    config  config.ModelArgs.from_config on the bytes after the first as JSON (any value), or (first
            byte odd) on tiny_config() with fields set to JSON values drawn from them: returns or
            raises ValueError; a returned config has a finite positive softmax scale
    v32exp, dsml32, dsml4
            chat.parse never raises on a completion and its result holds together (spans tile the
            text in chars and bytes, calls have JSON object arguments, finish_reason follows the
            calls); chat.StreamParser fed the same text in str chunks, and its UTF-8 in byte chunks,
            gives what one piece gives: the same text, calls, errors, spans and finish reason, and
            each call's argument pieces add up to its arguments

Chat input layout: byte 0 = flags (bit 0: the prompt ends with <think>; bit 1: a tool list is given;
bits 2-4: k - 1), bytes 1..k = chunk sizes (mod 48, cycled; 0 feeds an empty chunk), the rest = the
completion's UTF-8 (an invalid byte is a lone surrogate in the str chunks, U+FFFD in the byte ones).
tests/test_fuzz.py runs every target on its seeds and deterministic mutations, without atheris.
"""
import argparse
import contextlib
import functools
import json
import math
import random
import sys
import tempfile
from pathlib import Path

try:
    import atheris
except ImportError:                                  # the smoke tests run the targets without it
    atheris = None

# instrumented for coverage only when fuzzing; instrument_imports must see the first import
with atheris.instrument_imports(include=["chat", "checkpoint", "config", "rope"]) \
        if atheris and __name__ == "__main__" else contextlib.nullcontext():
    import chat
    import checkpoint
    import config

# -----------------------------------------------------------------------------
# header: checkpoint.read_header


@functools.cache
def scratch():  # one file rewritten per input: read_header takes a path
    return tempfile.NamedTemporaryFile(prefix="fuzz-", suffix=".safetensors")


def drawn_header(d):  # a file of a few tensors whose fields are right, or replaced by any JSON value
    header, offset = {}, 0
    for i in range(d.int() % 4 + 1):
        dtype, shape = d.pick(list(checkpoint.DTYPES)), [d.int() % 5 for _ in range(d.int() % 4)]
        nbytes = math.prod(shape) * checkpoint.DTYPES[dtype].itemsize
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        for _ in range(d.int() % 3):
            entry[d.pick(list(entry))] = d.json()
        header[f"t{i}"], offset = entry, offset + nbytes
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + bytes(offset)


def fuzz_header(data):
    data = drawn_header(Draw(data[1:])) if data[:1] and data[0] % 2 else data[1:]
    f = scratch()
    f.seek(0)
    f.truncate()
    f.write(data)
    f.flush()
    try:
        out = checkpoint.read_header(f.name)
    except checkpoint.CheckpointError:
        return
    for dtype, shape, begin, end in out.values():       # what it accepted is what the file holds
        assert all(type(d) is int and d >= 0 for d in shape), shape
        assert 8 <= begin <= end <= len(data) and end - begin == math.prod(shape) * dtype.itemsize, (begin, end)


def header_seeds():
    import numpy as np
    tensors = [{"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
               {"a.weight": np.zeros((4, 2), checkpoint.DTYPES["F8_E4M3"]), "a.weight_scale_inv": np.ones((1, 1), np.float32),
                "b": np.zeros(3, checkpoint.DTYPES["BF16"]), "c": np.zeros((), np.int64), "e": np.zeros((0, 5), np.bool_)},
               {}]
    seeds = []
    for t in tensors:
        checkpoint.save_safetensors(scratch().name, t)
        seeds.append(Path(scratch().name).read_bytes())
    meta = b'{"__metadata__":{"format":"pt"},"x":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}}'
    seeds.append(len(meta).to_bytes(8, "little") + meta + b"\x01\x02")
    return [b"\x00" + s for s in seeds] + [b"\x01" + bytes((i * 53 + j * 29) % 256 for j in range(32)) for i in range(8)]


# -----------------------------------------------------------------------------
# config: config.ModelArgs.from_config

class Draw:
    """Values drawn from the input's bytes, in order; zeros once they run out, so any input is valid."""

    def __init__(self, data):
        self.data, self.i = data, 0

    def int(self, n=1):
        self.i += n
        return int.from_bytes(self.data[self.i - n:self.i], "little")

    def pick(self, seq):
        return seq[self.int() % len(seq)]

    def json(self, depth=2):  # any JSON value, with a taste for the edges
        kind = self.int() % 8
        if kind == 0:
            return self.pick([None, True, False, "", "yarn", "silu", "fp8", "noaux_tc", "sigmoid"])
        if kind == 1:
            return self.pick([0, 1, -1, 2, 3, 64, 127, 128, 129, 256, 2 ** 31, 2 ** 63, 2 ** 64, 10 ** 4299])
        if kind == 2:
            return self.int(2) - self.int() % 2 * 65536
        if kind == 3:
            return self.pick([0.0, -0.0, 0.5, 1.0, 1.5, 40.0, 1e-300, 1e308, math.inf, -math.inf, math.nan])
        if kind == 4 and depth:
            return [self.json(depth - 1) for _ in range(self.int() % 4)]
        if kind == 5 and depth:
            return {self.pick(CONFIG_KEYS): self.json(depth - 1) for _ in range(self.int() % 4)}
        if kind == 6:
            return self.pick(list(checkpoint.tiny_config().values()))
        return self.data[self.i:self.i + self.int() % 8].decode("utf-8", "replace")


CONFIG_KEYS = sorted(set(checkpoint.tiny_config()) | set(config.ModelArgs.REQUIRED)
                     | {"max_seq_len", "softmax_scale", "rope_type", "factor", "original_max_position_embeddings",
                        "mscale", "type", "quant_method", "weight_block_size"})


def mutated_config(d):  # tiny_config() with a few fields (top level or one down) set to drawn values or removed
    cfg = checkpoint.tiny_config()
    for _ in range(d.int() % 6 + 1):
        key, where = d.pick(CONFIG_KEYS), cfg
        if d.int() % 4 == 0 and isinstance(cfg.get("rope_scaling"), dict):
            where = cfg["rope_scaling"]                   # a field of YaRN's sub-dict
        if d.int() % 8 == 0:
            where.pop(key, None)
        else:
            where[key] = d.json()
    return cfg


def fuzz_config(data):
    if data[:1] and data[0] % 2:
        cfg = mutated_config(Draw(data[1:]))
    else:
        try:
            cfg = json.loads(data[1:])
        except (ValueError, RecursionError):             # not JSON: checkpoint.read_json's business
            return
    try:
        args = config.ModelArgs.from_config(cfg)
    except ValueError:
        return
    assert math.isfinite(args.softmax_scale) and args.softmax_scale > 0, args.softmax_scale
    args.yarn_active, args.rope_factor, args.original_seq_len, args.fp8      # derived values can be read


def config_seeds():
    tiny = json.dumps(checkpoint.tiny_config()).encode()
    drawn = [b"\x01" + bytes((i * 37 + j * 11) % 256 for j in range(48)) for i in range(8)]   # structured
    return [b"\x00" + tiny, b"\x00" + tiny.replace(b'"yarn"', b'"none"'), b"\x00{}", b"\x00[]"] + drawn


# -----------------------------------------------------------------------------
# v32exp, dsml32, dsml4: chat.parse and chat.StreamParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def chunked(seq, sizes):  # seq cut into pieces of the given sizes, cycled; 0 is an empty piece
    out, i, k = [], 0, 0
    while i < len(seq):
        n = sizes[k % len(sizes)]
        out.append(seq[i:i + n])
        i, k = i + n, k + 1
    return out


def streamed(fmt, prompt, tools, chunks):  # -> parse()'s dict, from the events of a stream fed in chunks
    p = chat.StreamParser(fmt, prompt, tools)
    text, args = {"reasoning": [], "content": []}, {}
    for e in [e for c in chunks for e in p.feed(c)] + p.finish():
        if e["type"] in text:
            text[e["type"]].append(e["text"])
        elif e["type"] == "tool_call_arguments":
            args.setdefault(e["index"], []).append(e["text"])
        elif e["type"] == "tool_call_done":                  # the pieces streamed add up to the call
            assert "".join(args[e["index"]]) == e["arguments"], (args[e["index"]], e)
    return {"reasoning": "".join(text["reasoning"]) or None, "content": "".join(text["content"]) or None,
            "tool_calls": p.calls, "finish_reason": p.finish_reason, "errors": p.errors, "spans": p.spans}


def check_parse(r, text):  # a whole-text parse holds together
    spans = r["spans"]
    if text:
        assert spans[0]["chars"][0] == 0 and spans[-1]["chars"][1] == len(text), spans
        assert spans[-1]["bytes"][1] == len(chat.no_surrogates(text).encode("utf-8")), spans
    for a, b in zip(spans, spans[1:]):
        assert a["chars"][1] == b["chars"][0] and a["bytes"][1] == b["bytes"][0], (a, b)
    for c in r["tool_calls"]:
        assert isinstance(json.loads(c["arguments"]), dict), c
    assert r["finish_reason"] == ("tool_calls" if r["tool_calls"] else "stop")


def fuzz_chat(fmt, data):
    flags = data[0] if data else 0
    k = (flags >> 2) % 8 + 1
    sizes = [b % 48 for b in data[1:1 + k]]
    sizes = sizes if any(sizes) else [1]
    payload = data[1 + k:]
    prompt, tools = "<think>" if flags & 1 else "", TOOLS if flags & 2 else None
    text = payload.decode("utf-8", "surrogateescape")   # invalid bytes -> lone surrogates
    whole = chat.parse(text, fmt, prompt, tools)
    check_parse(whole, text)
    assert streamed(fmt, prompt, tools, chunked(text, sizes)) == whole
    if not text.isascii() and text != payload.decode("utf-8", "replace"):   # invalid UTF-8: U+FFFD per bad sequence
        whole = chat.parse(payload, fmt, prompt, tools)
    assert streamed(fmt, prompt, tools, chunked(payload, sizes)) == whole


def chat_seeds(fmt):
    u = {"role": "user", "content": "Weather in 杭州?"}
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"location": "杭州", "days": 2}}},
             {"type": "function", "function": {"name": "now", "arguments": {}}}]
    prompt = chat.encode([u], fmt=fmt)
    texts = []
    for msg in ({"role": "assistant", "content": "Let me check.", "tool_calls": calls},
                {"role": "assistant", "content": None, "tool_calls": calls[1:]},
                {"role": "assistant", "content": "Sunny, 5 < 6 and <｜ is no marker 😀"}):
        full = chat.encode([u, msg], fmt=fmt, add_generation_prompt=False)
        done = full[len(prompt):]                        # what the model wrote, EOS included
        texts += [done, "plan </think>" + done, done[:len(done) // 2], done.replace("}", "", 1),
                  done.replace("get_weather", "delete_all"), done.replace("2", "[" * 40)]
    d = chat.DSML
    texts += [f'\n\n<{d}tool_calls>\n<{d}invoke name="now"/>\n</{d}tool_calls>',
              f'<{d}invoke name="f">\n<{d}parameter name="k" string="maybe">1</{d}parameter>\n</{d}invoke>',
              "x" + chat.CALL_BEGIN + "f" + chat.TOOL_SEP + '{"a": 1}' + chat.CALL_END + "tail"]
    out = []
    for i, t in enumerate(texts):
        flags = (i % 4) | ((i % 3) << 2)                  # thinking / tools; 1..3 chunk sizes
        out.append(bytes([flags, 1, 7, 16][:2 + i % 3]) + t.encode("utf-8"))
    return out + [b"\x00\x01\xff\xfe" + "東京".encode()[:-1], b"\x01\x00\x01</think>\xed\xa0\x80"]


def markers(fmt):
    if fmt == "v32exp":
        return [chat.CALLS_BEGIN, chat.CALLS_END, chat.CALL_BEGIN, chat.CALL_END, chat.TOOL_SEP, chat.EOS,
                chat.END_THINK, "{}", '{"a": 1}']
    d, block = chat.DSML, "function_calls" if fmt == "dsml32" else "tool_calls"
    return [f"\n\n<{d}{block}>", f"</{d}{block}>", f'<{d}invoke name="', f"</{d}invoke>", '">', '"/>',
            f'<{d}parameter name="', '" string="true', '" string="false', f"</{d}parameter>", chat.EOS, chat.END_THINK]


# -----------------------------------------------------------------------------
# name -> (target, seeds, dictionary words)

TARGETS = {
    "header": (fuzz_header, header_seeds, ["dtype", "shape", "data_offsets", "__metadata__", "F8_E4M3", "BF16", "I64",
                                           "true", "null", "-1", "1e9", "[" * 64, "9" * 40, '"F32"', "[1,2]", "{}"]),
    "config": (fuzz_config, config_seeds, CONFIG_KEYS),
    **{fmt: (functools.partial(fuzz_chat, fmt), functools.partial(chat_seeds, fmt), markers(fmt)) for fmt in chat.FORMATS},
}


def mutations(seeds, words, n, seed=0):
    """n inputs from the seeds by libFuzzer's simplest moves (flip, insert a word, erase, splice,
    truncate), several stacked: for running the targets without atheris."""
    rng = random.Random(seed)
    for _ in range(n):
        x = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            i = rng.randint(0, len(x))
            move = rng.randrange(5)
            if move == 0 and i < len(x):
                x[i] ^= 1 << rng.randrange(8)
            elif move == 1:
                x[i:i] = rng.choice(words).encode("utf-8")
            elif move == 2:
                del x[i:i + rng.randint(1, 16)]
            elif move == 3:
                other = rng.choice(seeds)
                x[i:] = other[rng.randint(0, len(other)):]
            else:
                del x[i:]
        yield bytes(x)


def libfuzzer_dict(words):  # the -dict= file format: one quoted string a line, bytes as \xNN
    return "".join('"' + "".join(f"\\x{b:02x}" for b in w.encode("utf-8")) + '"\n' for w in words)


def main():
    ap = argparse.ArgumentParser(description="Fuzz one target with atheris (libFuzzer); see the module docstring.")
    ap.add_argument("target", nargs="?", choices=list(TARGETS), help="what to fuzz")
    ap.add_argument("libfuzzer", nargs=argparse.REMAINDER, help="libFuzzer flags and corpus folders, e.g. -runs=1000000")
    ap.add_argument("--list", action="store_true", help="print the targets and exit")
    a = ap.parse_args()
    if a.list or not a.target:
        print("\n".join(TARGETS))
        return
    if atheris is None:
        sys.exit("atheris is not installed: .venv/bin/pip install atheris==3.0.0")
    target, seeds, words = TARGETS[a.target]
    work = Path(tempfile.mkdtemp(prefix=f"fuzz-{a.target}-"))
    (work / "seeds").mkdir()
    for i, s in enumerate(seeds()):
        (work / "seeds" / f"seed{i:03d}").write_bytes(s)
    (work / "dict").write_text(libfuzzer_dict(words))
    flags = [f for f in ("-rss_limit_mb=2048", "-timeout=10", f"-dict={work / 'dict'}")
             if not any(x.startswith(f.split("=")[0] + "=") for x in a.libfuzzer)]
    argv = [sys.argv[0], *flags, *a.libfuzzer, str(work / "seeds")]
    print(f"fuzz.py: target {a.target}, {len(seeds())} seeds and a dictionary in {work}; libFuzzer {' '.join(argv[1:])}",
          flush=True)
    atheris.Setup(argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
