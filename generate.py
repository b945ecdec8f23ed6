"""Generate text from a DeepSeek-V3.2-Exp checkpoint (real layout, or the bundled tiny one).

    python generate.py --ckpt DIR --prompt "Hello"            one prompt, streamed
    python generate.py --ckpt DIR --input-file prompts.txt    prompts split on blank lines, one batch
    python generate.py --ckpt DIR --interactive               a chat; /clear resets, /exit quits

The loop is the official demo's (spec/dsv32.md §6): prefill the shortest prompt, then one token at a
time, longer prompts teacher-forced; sampling is argmax(softmax(logits / T) / Exp(1)), an exact
categorical draw; temperature 0 is greedy. Unlike the demo, a chat turn reuses the cached
conversation and prefills only the new tokens (a prefill chunk at start_pos > 0).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

import chat
from model import Transformer


def load_tokenizer(ckpt):
    from tokenizers import Tokenizer
    path = Path(ckpt) / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} is missing: this checkpoint has no tokenizer, so text cannot be encoded")
    return Tokenizer.from_file(str(path))


def sample(logits, temperature, rng):  # [B, V] f32 -> [B] int
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits / max(temperature, 1e-5)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p / rng.exponential(size=p.shape)).argmax(-1)          # exponential race = categorical


class Streamer:
    """Prints one sequence's new text as tokens arrive, holding back an incomplete UTF-8 tail."""

    def __init__(self, tok, out=sys.stdout):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def put(self, token_id):
        self.ids.append(int(token_id))
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return                                                  # wait for the rest of the character
        self.out.write(text[len(self.shown):])
        self.out.flush()
        self.shown = text


def generate(model, prompts, max_new_tokens, eos_id, temperature=0.0, rng=None, on_token=None, reuse=0):
    """prompts: lists of token ids -> (completions, stats). reuse > 0 (batch of one): the model's
    caches already hold prompts[0][:reuse], so only the rest is prefilled (a chunk at start_pos=reuse)."""
    rng = rng or np.random.default_rng(0)
    B = len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("an empty prompt cannot be generated from")
    total = max(lens) + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"max_seq_len {model.args.max_seq_len}; shorten the prompt or raise --max-seq-len")
    tokens = np.full((B, total), -1, np.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    is_prompt = tokens >= 0
    finished = np.zeros(B, bool)
    stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0}
    prev = reuse
    for cur in range(min(lens), total):
        t0 = time.perf_counter()
        logits = model.forward(tokens[:, prev:cur], start_pos=prev)
        nxt = sample(logits, temperature, rng)
        nxt = np.where(is_prompt[:, cur], tokens[:, cur], nxt)         # teacher-force longer prompts
        tokens[:, cur] = nxt
        kind = "prefill" if prev == reuse else "decode"
        stats[kind + "_tokens"] += B * (cur - prev)
        stats[kind + "_s"] += time.perf_counter() - t0
        if on_token is not None and not is_prompt[0, cur] and not finished[0]:
            on_token(nxt[0])
        finished |= ~is_prompt[:, cur] & (nxt == eos_id)
        prev = cur
        if finished.all():
            break
    out = []
    for i, n in enumerate(lens):
        c = tokens[i, n:n + max_new_tokens]
        c = c[c >= 0].tolist()
        out.append(c[:c.index(eos_id)] if eos_id in c else c)
    stats["cached"] = tokens[0, :prev].tolist() if B == 1 else None   # what the caches hold now
    return out, stats


def report(stats, err=sys.stderr):
    def rate(n, s):
        return f"{n / s:.1f} tok/s" if s > 0 else "n/a"
    print(f"\nprefill: {stats['prefill_tokens']} tokens in {stats['prefill_s']:.2f} s ({rate(stats['prefill_tokens'], stats['prefill_s'])}); "
          f"decode: {stats['decode_tokens']} tokens in {stats['decode_s']:.2f} s ({rate(stats['decode_tokens'], stats['decode_s'])})",
          file=err)


def encode(tok, text, raw):
    prompt = text if raw else chat.render([{"role": "user", "content": text}])
    return tok.encode(prompt, add_special_tokens=False).ids


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder: config.json, safetensors shards + index, tokenizer.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (a single user turn unless --raw)")
    src.add_argument("--input-file", help="a text file of prompts separated by blank lines, generated as one batch")
    src.add_argument("--interactive", action="store_true", help="chat on stdin; /clear resets the conversation, /exit quits")
    ap.add_argument("--raw", action="store_true", help="feed the prompt text as is, without the chat format")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 is greedy (default 0.6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampler's random numbers (default 0)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"], help="numpy: the reference path (default)")
    ap.add_argument("--numerics", default="official", choices=["official", "exact"],
                    help="official: the official model's bf16/FP8 rounding (default); exact: float32 throughout")
    ap.add_argument("--attention", default="sparse", choices=["sparse", "dense"],
                    help="sparse: DSA top-k selection (default); dense: every causal key (V3.1-Terminus behaviour)")
    ap.add_argument("--indexer", default=None, choices=["fp8", "exact"],
                    help="indexer precision (default: fp8 with official numerics, exact with exact numerics)")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="context length for caches and YaRN (default: the config's max_position_embeddings)")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")
    if a.max_seq_len is not None and a.max_seq_len < 1:
        ap.error("--max-seq-len must be positive")
    if not Path(a.ckpt).is_dir():
        ap.error(f"--ckpt {a.ckpt}: no such folder")

    tok = load_tokenizer(a.ckpt)
    print(f"loading {a.ckpt} (memory-mapped; weights are read as layers use them)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        model = Transformer.from_pretrained(a.ckpt, backend=a.backend, numerics=a.numerics, attention=a.attention,
                                            indexer=a.indexer, max_seq_len=a.max_seq_len)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    args = model.args
    print(f"loaded {args.num_hidden_layers} layers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"ckpt={a.ckpt} backend={a.backend} numerics={model.numerics} attention={model.attention} "
          f"indexer={model.indexer} max_seq_len={args.max_seq_len} yarn={'on' if args.yarn_active else 'off'} "
          f"index_topk={args.index_topk} temperature={a.temperature} seed={a.seed} max_new_tokens={a.max_new_tokens}",
          file=sys.stderr)
    rng = np.random.default_rng(a.seed)
    eos = args.eos_token_id

    try:
        if a.prompt is not None:
            out, stats = generate(model, [encode(tok, a.prompt, a.raw)], a.max_new_tokens, eos, a.temperature, rng,
                                  Streamer(tok).put)
            print()
            report(stats)
        elif a.input_file is not None:
            path = Path(a.input_file)
            if not path.is_file():
                raise SystemExit(f"error: --input-file {path}: no such file")
            texts = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
            if not texts:
                raise SystemExit(f"error: --input-file {path} holds no prompt")
            print(f"generating {len(texts)} prompts as one batch", file=sys.stderr)
            out, stats = generate(model, [encode(tok, t, a.raw) for t in texts], a.max_new_tokens, eos,
                                  a.temperature, rng)
            for t, c in zip(texts, out):
                print(f"Prompt: {t}\nCompletion: {tok.decode(c, skip_special_tokens=True)}\n")
            report(stats)
        else:
            interactive(model, tok, a, rng, eos)
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def interactive(model, tok, a, rng, eos):
    messages, cached = [], []                      # cached: the token ids the model's caches hold
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/clear":
            messages, cached = [], []
            continue
        messages.append({"role": "user", "content": line})
        ids = tok.encode(chat.render(messages), add_special_tokens=False).ids
        reuse = 0                                  # longest prefix already cached (at least one token left to feed)
        while reuse < min(len(cached), len(ids) - 1) and cached[reuse] == ids[reuse]:
            reuse += 1
        out, stats = generate(model, [ids], a.max_new_tokens, eos, a.temperature, rng, Streamer(tok).put, reuse)
        print()
        report(stats)
        cached = stats["cached"]
        messages.append({"role": "assistant", "content": tok.decode(out[0], skip_special_tokens=True)})


if __name__ == "__main__":
    main()
