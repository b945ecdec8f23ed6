"""Generate text from a DeepSeek-V3.2-Exp or V4-Flash checkpoint (real layout, or the bundled tiny ones).

    python generate.py --ckpt DIR --prompt "Hello"            one prompt, streamed
    python generate.py --ckpt DIR --input-file prompts.txt    prompts split on blank lines, one batch
    python generate.py --ckpt DIR --interactive               a chat; /clear resets, /exit quits
    python generate.py --ckpt DIR --interactive --thinking --tools tools.json   reasoning shown apart,
                                                              tool calls printed, their results asked for
    torchrun --nproc-per-node 8 generate.py --ckpt DIR ...    tensor/expert parallel over 8 GPUs
                                                              (parallel.py); rank 0 reads and prints

The loop is the official demo's (spec/dsv32.md §6): prefill the shortest prompt, then one token at a
time, longer prompts teacher-forced; sampling is argmax(softmax(logits / T) / Exp(1)), an exact
categorical draw; temperature 0 is greedy. Unlike the demo, a chat turn reuses the cached
conversation and prefills only the new tokens (a prefill chunk at start_pos > 0).
"""
import argparse
import json
import math
import numbers
import os
import re
import sys
import time
from pathlib import Path

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


def check_temperature(temperature, name="temperature"):  # NaN would pick token 0 forever, -1 be greedy silently
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{name} {temperature}: must be a finite number >= 0 (0 is greedy)")


def sample(logits, temperature, rng):  # [B, V] f32 -> [B] int
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits / max(temperature, 1e-5)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p / rng.exponential(size=p.shape)).argmax(-1)          # exponential race = categorical


class ChatPrinter:
    """Token ids in, the parsed chat out as it streams: reasoning under a [reasoning] header, the
    answer under [answer] (headers only when there is reasoning), each tool call as one JSON line,
    malformed output noted on stderr."""

    def __init__(self, tok, fmt, prompt, tools=None, out=sys.stdout, err=sys.stderr):
        self.detok = chat.Detokenizer(tok)
        self.parser = chat.StreamParser(fmt, prompt, tools)
        self.out, self.err = out, err
        self.section, self.names, self.text = None, {}, {"reasoning": "", "content": ""}

    def token(self, token_id):
        self._show(self.parser.feed(self.detok.feed(token_id)))

    def finish(self):  # -> {"reasoning", "content", "tool_calls", "finish_reason", "errors"} as chat.parse
        self._show(self.parser.feed(self.detok.flush()) + self.parser.finish())
        p = self.parser
        return {"reasoning": self.text["reasoning"] or None, "content": self.text["content"] or None,
                "tool_calls": p.calls, "finish_reason": p.finish_reason, "errors": p.errors}

    def _show(self, events):
        for e in events:
            kind = e["type"]
            if kind in ("reasoning", "content"):
                if self.section != kind and (kind == "reasoning" or self.section == "reasoning"):
                    self.out.write(("\n" if self.section else "") + f"[{'reasoning' if kind == 'reasoning' else 'answer'}] ")
                self.section = kind
                self.text[kind] += e["text"]
                self.out.write(e["text"])
            elif kind == "tool_call":
                self.names[e["index"]] = e["name"]
            elif kind == "tool_call_done":
                call = {"name": self.names[e["index"]], "arguments": json.loads(e["arguments"])}
                self.out.write("\n[tool call] " + json.dumps(call, ensure_ascii=False) + "\n")
            elif kind == "error":
                self.err.write(f"\n[malformed model output: {e['reason']}] {e['text']!r}\n")
        self.out.flush()


def _on_cuda(model):  # a torch model on a CUDA GPU in official numerics: its decode step is capturable
    opts = getattr(model, "opts", model)                          # V3.2 keeps its options in .opts, V4 on itself
    ops = getattr(opts, "ops", None)
    return ops is not None and ops.name == "torch" and ops.device.type == "cuda" and opts.official and \
        (opts is not model or ops.v4_attention_step is not None)   # V4: its step needs the V4 kernels


def generate(model, prompts, max_new_tokens, eos_id, temperature=0.0, rng=None, on_token=None, reuse=0,
             cuda_graph=True):
    """prompts: lists of token ids -> (completions, stats). reuse > 0 (batch of one): the model's
    caches already hold prompts[0][:reuse], so only the rest is prefilled (a chunk at start_pos=reuse).
    On a CUDA device the decode steps replay one captured CUDA graph (cuda_graph=False: plain steps)."""
    check_temperature(temperature)
    rng = rng or np.random.default_rng(0)
    B = len(prompts)
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("an empty prompt cannot be generated from")
    total = max(lens) + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"max_seq_len {model.args.max_seq_len}; shorten the prompt or raise --max-seq-len")
    model.reserve(B, total)                                          # caches allocated once, up front
    tokens = np.full((B, total), -1, np.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    is_prompt = tokens >= 0
    finished = np.zeros(B, bool)
    stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0}
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
        if not isinstance(logits, np.ndarray) and temperature <= 0:   # torch, greedy: only the token comes back
            nxt = logits.argmax(-1).cpu().numpy()
        else:
            if not isinstance(logits, np.ndarray):
                logits = logits.float().cpu().numpy()
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


def show_progress(i, n, err=sys.stderr):  # loading: one line redrawn per layer
    bar = "#" * (30 * i // n)
    err.write(f"\rloading layers [{bar:<30}] {i}/{n}" + ("\n" if i == n else ""))
    err.flush()


def report(stats, err=sys.stderr):
    def rate(n, s):
        return f"{n / s:.1f} tok/s" if s > 0 else "n/a"
    print(f"\nprefill: {stats['prefill_tokens']} tokens in {stats['prefill_s']:.2f} s ({rate(stats['prefill_tokens'], stats['prefill_s'])}); "
          f"decode: {stats['decode_tokens']} tokens in {stats['decode_s']:.2f} s ({rate(stats['decode_tokens'], stats['decode_s'])})",
          file=err)


def load_tools(path):  # an OpenAI-style JSON tool list, in the shape chat.py's tool blocks read
    """[{"type": "function", "function": {"name": str, "description"?: str, "parameters"?: object}}, ...],
    or the bare function objects; anything else is a ValueError naming the file and the tool."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--tools {p}: no such file")
    try:
        tools = checkpoint.read_json(p)
    except CheckpointError as e:
        raise ValueError(f"--tools {e}") from None
    if not isinstance(tools, list):
        raise ValueError(f"--tools {p}: expected a JSON list of tools, each with a function name; "
                         f"got {checkpoint.json_type(tools)}")
    for i, t in enumerate(tools):
        where = f"--tools {p}: tool {i}"
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
    if device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device}: expected cpu, cuda or cuda:N")
    if backend == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"--device {device} needs --backend torch (the NumPy reference runs on the CPU)")
        return device
    try:
        import torch
    except ImportError:
        raise ValueError("--backend torch needs PyTorch, which is not installed here (pip install torch)") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        return "cuda" if gpus else "cpu"
    if device != "cpu" and int(device.partition(":")[2] or 0) >= gpus:    # caught here, not as a traceback later
        raise ValueError(f"--device {device}: " + (f"this host has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}" if gpus
                                                   else "no GPU is visible here (use --device cpu)"))
    return device


def user_turn(tok, text, a):  # one user turn (or the raw text) -> (prompt text, token ids)
    prompt = text if a.raw else chat.encode([{"role": "user", "content": text}], fmt=a.chat_format,
                                            thinking=a.thinking, tools=a.tool_list)
    return prompt, tok.encode(prompt, add_special_tokens=False).ids


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 done; 2 bad input (flags, files, checkpoint), reported on one line 'error: ...' "
               "(--debug shows the traceback instead; argparse's own usage errors are 2 as well); 130 interrupted "
               "(Ctrl-C); with --verify: 0 pass, 1 fail, 3 nothing compared.")
    ap.add_argument("--ckpt", required=True, help="checkpoint folder: config.json, safetensors shards + index, tokenizer.json")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (a single user turn unless --raw)")
    src.add_argument("--input-file", help="a text file of prompts separated by blank lines, generated as one batch")
    src.add_argument("--interactive", action="store_true", help="chat on stdin; /clear resets the conversation, /exit quits")
    src.add_argument("--verify", action="store_true",
                     help="check the chosen backend against the NumPy reference and the recorded goldens, then exit")
    ap.add_argument("--raw", action="store_true", help="feed the prompt text as is, without the chat format")
    ap.add_argument("--chat-format", choices=chat.FORMATS, default=None,
                    help="v32exp (V3.1/V3.2-Exp template), dsml32 (V3.2), dsml4 (V4); default: from the checkpoint "
                         "(its tokenizer_config.json chat_template, else its model_type)")
    ap.add_argument("--thinking", action="store_true", help="thinking mode: the model reasons first; shown apart")
    ap.add_argument("--tools", default=None, help="an OpenAI-style JSON tool list, described in the system prompt")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt (default 200)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 is greedy (default 0.6)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampler's random numbers (default 0)")
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
    ap.add_argument("--verify-layers", type=int, default=None,
                    help="--verify: compare only the first N layers (for checkpoints too large for the CPU reference)")
    ap.add_argument("--record-golden", action="store_true", help="--verify: record this combination's golden outputs")
    ap.add_argument("--max-seq-len", type=int, default=None,
                    help="context length for caches and YaRN (default: the config's max_position_embeddings)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch on the CPU: intra-op threads (default 1: a decode step's ops are too small to split, "
                         "and threads that wait for each other on a busy machine made it 10x slower)")
    ap.add_argument("--debug", action="store_true", help="on an error, show the Python traceback, not one line")
    a = ap.parse_args(argv)
    try:
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


def run(a):  # main's work once the flags are parsed; bad input raises one of USER_ERRORS
    if a.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens}: must be at least 1")
    if a.max_seq_len is not None and a.max_seq_len < 1:
        raise ValueError(f"--max-seq-len {a.max_seq_len}: must be positive")
    if a.seed < 0:
        raise ValueError(f"--seed {a.seed}: must be >= 0")
    check_temperature(a.temperature, "--temperature")
    if not a.verify and (a.verify_layers is not None or a.record_golden):
        raise ValueError(f"{'--verify-layers' if a.verify_layers is not None else '--record-golden'} needs --verify")
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
    a.device = resolve_device(a.backend, a.device)
    if a.threads is not None and (a.threads < 1 or a.backend != "torch" or a.device != "cpu"):
        raise ValueError(f"--threads {a.threads}: must be >= 1, and applies to --backend torch --device cpu")
    if a.backend == "torch" and a.device == "cpu" and a.parallel is None:
        import torch
        torch.set_num_threads(a.threads or 1)
    if a.verify:
        import verify
        raise SystemExit(verify.verify(a.ckpt, a.backend, a.device, a.numerics, a.verify_layers,
                                       a.record_golden))  # 0 PASS, 1 FAIL, 3 nothing compared
    a.tool_list = load_tools(a.tools)
    tok = load_tokenizer(a.ckpt)                          # first: it checks what default_format reads
    a.chat_format = a.chat_format or chat.default_format(a.ckpt)

    print(f"loading {a.ckpt} (memory-mapped; weights are read as layers use them)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model = Transformer.from_pretrained(a.ckpt, backend=a.backend, numerics=a.numerics, attention=a.attention,
                                        indexer=a.indexer, max_seq_len=a.max_seq_len, device=a.device,
                                        progress=show_progress, parallel=a.parallel, experts=a.experts)
    args = model.args
    print(f"loaded {args.num_hidden_layers} layers in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(f"ckpt={a.ckpt} backend={a.backend} numerics={model.numerics} attention={model.attention} "
          f"indexer={model.indexer} device={a.device or 'cpu'} max_seq_len={args.max_seq_len} yarn={'on' if args.yarn_active else 'off'} "
          f"index_topk={args.index_topk} chat_format={'raw' if a.raw else a.chat_format} thinking={a.thinking} "
          f"tools={len(a.tool_list or [])} temperature={a.temperature} seed={a.seed} max_new_tokens={a.max_new_tokens}"
          + (f" ranks={a.parallel.world}" if a.parallel else ""), file=sys.stderr)
    rng = np.random.default_rng(a.seed)
    eos = args.eos_token_id

    try:
        if a.prompt is not None:
            prompt, ids = user_turn(tok, a.prompt, a)
            printer = ChatPrinter(tok, "v32exp" if a.raw else a.chat_format, "" if a.raw else prompt, a.tool_list)
            out, stats = generate(model, [ids], a.max_new_tokens, eos, a.temperature, rng, printer.token)
            printer.finish()
            print()
            report(stats)
        elif a.input_file is not None:
            path = Path(a.input_file)
            if not path.is_file():
                raise FileNotFoundError(f"--input-file {path}: no such file")
            try:
                texts = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
            except UnicodeDecodeError as e:
                raise ValueError(f"--input-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not texts:
                raise ValueError(f"--input-file {path} holds no prompt")
            print(f"generating {len(texts)} prompts as one batch", file=sys.stderr)
            turns = [user_turn(tok, t, a) for t in texts]
            out, stats = generate(model, [ids for _, ids in turns], a.max_new_tokens, eos, a.temperature, rng)
            for t, (prompt, _), c in zip(texts, turns, out):
                text = tok.decode(c, skip_special_tokens=True)
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
            interactive(model, tok, a, rng, eos, read=input if a.parallel is None else shared_input)
    finally:
        if a.parallel is not None:
            import torch.distributed as dist
            dist.destroy_process_group()


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


def interactive(model, tok, a, rng, eos, read=input, out=sys.stdout):
    """A multi-turn chat. Each model turn reuses the cached conversation (only what the caches lack
    is prefilled); a tool call is printed and its result asked for, then the model goes on."""
    messages, cached = [], []                        # cached: the token ids the model's caches hold
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/clear":
            messages, cached = [], []
            continue
        messages.append({"role": "user", "content": line})
        while True:                                  # model turns until it answers without a tool call
            prompt = chat.encode(messages, fmt=a.chat_format, thinking=a.thinking, tools=a.tool_list)
            ids = tok.encode(prompt, add_special_tokens=False).ids
            reuse = 0                                # the longest prefix already cached, one token left to feed
            while reuse < min(len(cached), len(ids) - 1) and cached[reuse] == ids[reuse]:
                reuse += 1
            if reuse < len(cached) and not model.can_rewind:   # V4: its caches hold no earlier positions
                reuse = 0
            printer = ChatPrinter(tok, a.chat_format, prompt, a.tool_list, out=out)
            _, stats = generate(model, [ids], a.max_new_tokens, eos, a.temperature, rng, printer.token, reuse)
            r = printer.finish()
            print(file=out)
            report(stats)
            cached = stats["cached"]
            reply = {"role": "assistant", "content": r["content"] or ""}
            if r["reasoning"]:
                reply["reasoning_content" if a.chat_format == "dsml32" else "reasoning"] = r["reasoning"]
            if r["tool_calls"]:
                reply["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in r["tool_calls"]]
            messages.append(reply)
            if not r["tool_calls"]:
                break
            for c in r["tool_calls"]:
                try:
                    result = read(f"result of {c['name']}> ")
                except EOFError:
                    return
                messages.append({"role": "tool", "content": result})


if __name__ == "__main__":
    main()
