"""Check an OpenAI-compatible inference engine against this reference (the oracle), token by token.

    .venv/bin/python check_engine.py --url http://127.0.0.1:8000/v1 --ckpt tiny-v4            the quick suite
    .venv/bin/python check_engine.py --url URL --ckpt DIR --suite full --out report/            all cases, a JSON report
    .venv/bin/python check_engine.py --url URL --ckpt DIR --backend torch --device cuda         the reference on a GPU

The server at --url serves the checkpoint in --ckpt (vLLM, SGLang, serve.py, ...). For each case of the
suite this sends token ids and compares what the engine says with what this project's model computes,
loaded as generate.py loads it (generate.py's loading flags: --backend, --device, --numerics, ...):

  prompt logprobs   POST /v1/completions {prompt: token ids, max_tokens: 1, prompt_logprobs: K} (vLLM's field;
                    serve.py has it) against the float64 log-softmax of model.forward(ids, all_positions=True).
                    Position p is the output at token p (the logprob of token p+1 given tokens 0..p). Per
                    case: the positions compared, top-1 agreement (the engine's rank-1 token is the
                    reference's argmax), the largest |delta logprob| of the actual tokens and its first
                    position over the tolerance, the largest |delta| over the top K the engine reports.
  greedy decode     {max_tokens: N, temperature: 0, logprobs: K} against generate.generate's greedy tokens and
                    the model's own step logits (prefill, then one decode step per token): the first step
                    where the tokens part, and |delta logprob| of the tokens both chose. A parting where the
                    reference's two candidates lie within the tolerance of each other is a near tie (pass).

The suite, each case named after what it would catch (--suite quick: the short ones, seconds on the tiny
checkpoints; full: longer prompts and decodes):
  compress-mod4-rR    prompt lengths 4k..4k+3: V4's compressors (ratio 4) at every residue of a window
  window-W-1/W/W+1    V4 only: prompts across the sliding window (128 in the released model)
  past-index-topk     a context longer than index_topk (the indexer's top-k selects, not all keys);
                      skipped in the quick suite past 256 tokens, in the full one past the context
  long-context        full only, 320 tokens: a fault that starts deep in the context
  prefix-cache        a prompt P (24 tokens quick, 48 full), then P + more: the second request's logprobs over P must be the first's
                      (an engine's prefix cache reused), and both the reference's
  greedy-decode       16 (quick) / 64 (full) greedy tokens after 8 / 16, their logprobs

Tolerance (--tolerance, default 0.25 nats: the largest |delta logprob| of the actual tokens a case may
have; --allow-outliers, default 0: the fraction of positions that may exceed it). A server running this
code in the same numerics (serve.py with the same flags) gives differences of exactly 0 (float64 noise at
most); the report shows the value. An engine in bf16/FP8 differs by rounding, and by the discrete
choices rounding moves (the indexer's top-k, which expert is routed): measured between two
implementations of this project's official numerics (the NumPy reference and the torch backend on the
CPU, the same prompts as this suite's) the largest |delta| of the actual tokens was 0.116 on the trained
small-v32 (median 7e-7), 0 on tiny-v4 and 0.78 on tiny-v32 (random weights, where an FP8 top-k flip moves
a position far: 13% of its positions over 0.05). The default is small-v32's 0.116 with a margin of two;
a wrong computation (a swapped weight row, a mis-rotated position, a cache read at the wrong place) moves
logprobs by a nat or more. Between this project's exact (float32) and official numerics, a different
rounding recipe, the spread is far larger (max 1.4 on small-v32, 3.2 on tiny-v32): compare an engine with
the reference in the numerics it implements (--numerics), or raise --tolerance knowingly.

Output: a table on stdout (case, positions compared, top-1 agreement, worst |delta| and where, verdict);
--out DIR: report.json there. Exit status: 0 every case passes, 1 any fails (the table and the JSON name
the case and its first bad position), 2 bad input, one line "error: ..." (an unreachable URL, a model the
server does not serve, a checkpoint whose vocabulary is not the server's: probed by sending token ids
across the vocabulary and reading back the engine's decoded tokens).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import generate
import progress

with progress.needs_setup("check_engine.py", "./setup.sh --serve", active=__name__ == "__main__"):
    import httpx2
    import serve                                 # its log_softmax and Recorder: the numbers serve.py returns

TOLERANCE = 0.25                                 # nats; see the docstring for how it was derived
TOP_K = 5                                        # the top logprobs asked for per position


class BadInput(ValueError):
    pass


class Engine:
    """The server under test: its /v1 API through httpx2, every wait bounded."""

    def __init__(self, url, api_key=None, timeout=600):
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx2.Client(timeout=timeout, headers=headers)
        self.model = None

    def get(self, path):
        return self._json(lambda: self.http.get(self.url + path), path)

    def post(self, path, body):
        return self._json(lambda: self.http.post(self.url + path, json=body), path)

    def _json(self, call, path):
        try:
            r = call()
        except httpx2.HTTPError as e:
            raise BadInput(f"{self.url}{path}: {type(e).__name__}: {e}") from None
        try:
            body = r.json()
        except ValueError:
            raise BadInput(f"{self.url}{path}: HTTP {r.status_code}, not JSON: {r.text[:200]!r}") from None
        if r.status_code != 200:
            msg = body.get("error", {}).get("message") if isinstance(body, dict) else None
            raise BadInput(f"{self.url}{path}: HTTP {r.status_code}: {msg or str(body)[:200]}")
        return body

    def pick_model(self, name):  # the served model's name, from /v1/models
        served = [m.get("id") for m in self.get("/models").get("data", [])]
        if name is None and len(served) == 1:
            name = served[0]
        if name not in served:
            raise BadInput(f"model {name!r} is not served at {self.url} (it serves: {', '.join(map(str, served))})"
                           if name else f"{self.url} serves {len(served)} models ({', '.join(map(str, served))}): "
                           "name one with --model")
        self.model = name
        return name

    def prompt_logprobs(self, ids, k=TOP_K):  # -> [None, {token id: {"logprob", "rank", ...}}, ...] per prompt token
        r = self.post("/completions", {"model": self.model, "prompt": list(map(int, ids)), "max_tokens": 1,
                                       "temperature": 0, "prompt_logprobs": k})
        pl = r["choices"][0].get("prompt_logprobs") or r.get("prompt_logprobs")
        if not isinstance(pl, list) or len(pl) != len(ids):
            raise BadInput(f"{self.url}/completions: no prompt_logprobs of {len(ids)} entries in the reply "
                           "(the engine needs vLLM's prompt_logprobs)")
        return pl

    def greedy(self, ids, n, k=TOP_K):  # -> (token strings, their logprobs, finish_reason)
        r = self.post("/completions", {"model": self.model, "prompt": list(map(int, ids)), "max_tokens": n,
                                       "temperature": 0, "logprobs": k, "return_tokens_as_token_ids": True})
        c = r["choices"][0]
        lp = c.get("logprobs") or {}
        return lp.get("tokens") or [], lp.get("token_logprobs") or [], c.get("finish_reason")


class Reference:
    """This project's model and tokenizer: the oracle's numbers."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def text(self, t):  # a token's text as serve.py (and vLLM) report it
        return self.tok.decode([int(t)], skip_special_tokens=False)

    def logprobs(self, ids):  # [len(ids), V] float64: row p predicts token p+1
        logits = self.model.forward([list(ids)], start_pos=0, all_positions=True)
        logits = logits if isinstance(logits, np.ndarray) else logits.float().cpu().numpy()
        return serve.log_softmax(logits[0])

    def greedy(self, ids, n):  # -> (greedy tokens, the step logprobs [n, V])
        model, rows = serve.Recorder(self.model), []
        out, _ = generate.generate(model, [list(ids)], n, self.model.args.eos_token_id, temperature=0,
                                   cuda_graph=False, on_token=lambda t: rows.append(serve.log_softmax(model.last[0])))
        return out[0], rows


def engine_token_id(s, ref, want):  # the engine's token string -> its id ("token_id:N" from vLLM), else want or None
    if isinstance(s, str) and s.startswith("token_id:") and s[9:].isdigit():
        return int(s[9:])
    return want if s == ref.text(want) else None


# -----------------------------------------------------------------------------
# The suite

def suite(args, name):  # -> [(case name, kind, spec)]; kind "prompt", "prefix" or "greedy"
    full = name == "full"
    v4 = hasattr(args, "sliding_window")
    cases = []
    k = 16 if full else 2
    for r in range(4):
        cases.append((f"compress-mod4-r{r}", "prompt", 4 * k + r))
    if v4:
        w = args.sliding_window
        cases += [(f"window-{w - 1}", "prompt", w - 1), (f"window-{w}", "prompt", w), (f"window-{w + 1}", "prompt", w + 1)]
    topk = getattr(args, "index_topk", None)
    if topk:
        n = topk + 16
        if n <= (args.max_seq_len if full else 256) - 1:
            cases.append(("past-index-topk", "prompt", n))
        else:
            cases.append(("past-index-topk", "skip", f"{n} tokens: too long for the {'context' if full else 'quick suite'}"))
    if full:
        cases.append(("long-context", "prompt", 320))
    cases.append(("prefix-cache", "prefix", (48, 24) if full else (16, 8)))
    cases.append(("greedy-decode", "greedy", (16, 64) if full else (8, 16)))
    return [(c, "skip", f"{spec} tokens: past the context") if kind == "prompt" and spec >= args.max_seq_len
            else (c, kind, spec) for c, kind, spec in cases]


def prompt_ids(n, seed, vocab):  # deterministic ordinary token ids (clear of the specials at both ends)
    return np.random.default_rng(seed).integers(3, min(vocab, 100_000), n).tolist()


# -----------------------------------------------------------------------------
# Comparisons

def compare_prompt(pl, lp, ids, tol, start=0):
    """The engine's prompt_logprobs against the reference's rows -> the case's numbers (positions from start)."""
    deltas, top1, topk = [], [], 0.0
    for p in range(start, len(ids) - 1):
        entry = pl[p + 1] or {}
        own = entry.get(str(ids[p + 1]))
        if own is None:
            raise BadInput(f"prompt_logprobs[{p + 1}] lacks the prompt's own token {ids[p + 1]}")
        deltas.append(abs(own["logprob"] - lp[p, ids[p + 1]]))
        ranked = sorted(((v.get("rank", 0), int(t)) for t, v in entry.items() if v.get("rank") is not None))
        if ranked:
            top1.append(ranked[0][0] == 1 and ranked[0][1] == int(np.argmax(lp[p])))
        for t, v in entry.items():
            topk = max(topk, abs(v["logprob"] - lp[p, int(t)]))
    return deltas, top1, topk


def verdict(deltas, tol, outliers, start=0):  # -> (pass, worst, first position over tol)
    d = np.asarray(deltas, np.float64)
    over = np.flatnonzero(~(d <= tol))                     # NaN counts as over
    worst = float(d.max()) if len(d) else 0.0
    return len(over) <= outliers * len(d), worst, (int(over[0]) + start if len(over) else None)


def run_case(name, kind, spec, eng, ref, a, vocab):
    row = {"case": name, "kind": kind}
    if kind == "skip":
        return row | {"verdict": "skip", "note": spec}
    if kind in ("prompt", "prefix"):
        n = spec if kind == "prompt" else sum(spec)
        ids = prompt_ids(n, seed=sum(map(ord, name)), vocab=vocab)
        lp = ref.logprobs(ids)
        notes = []
        if kind == "prefix":
            first = eng.prompt_logprobs(ids[:spec[0]])
            second = eng.prompt_logprobs(ids)
            same = [abs(first[i][str(ids[i])]["logprob"] - second[i][str(ids[i])]["logprob"])
                    for i in range(1, spec[0])]
            ok_p, worst_p, bad_p = verdict(same, a.tolerance, a.allow_outliers)
            row["prefix_vs_first"] = {"positions": len(same), "worst": worst_p, "first_bad": bad_p}
            if not ok_p:
                notes.append(f"second request differs from the first over the prefix at position {bad_p}")
            pl = second
        else:
            ok_p, pl = True, eng.prompt_logprobs(ids)
        deltas, top1, topk = compare_prompt(pl, lp, ids, a.tolerance)
        ok, worst, bad = verdict(deltas, a.tolerance, a.allow_outliers)
        if not ok:
            notes.append(f"first |delta| over {a.tolerance:g} at position {bad}")
        return row | {"tokens": n, "positions": len(deltas), "top1_agree": int(sum(top1)), "top1_of": len(top1),
                      "worst": worst, "first_bad": bad, "topk_worst": topk, "deltas": [float(x) for x in deltas],
                      "verdict": "pass" if ok and ok_p else "FAIL", "note": "; ".join(notes)}
    n_prompt, n_new = spec
    ids = prompt_ids(n_prompt, seed=sum(map(ord, name)), vocab=vocab)
    want, rows = ref.greedy(ids, n_new)
    toks, lps, finish = eng.greedy(ids, n_new)
    deltas, parted, note, ok = [], None, "", True
    for i, s in enumerate(toks):
        if i >= len(want):
            parted, note = i, f"the engine goes on past the reference's end ({len(want)} tokens, EOS)"
            ok = False
            break
        got = engine_token_id(s, ref, want[i])
        if got != want[i]:
            parted = i
            gap = float(rows[i][want[i]] - rows[i][got]) if got is not None else float("inf")
            ok = gap <= a.tolerance
            note = (f"parts at step {i}: engine {s!r}, reference {ref.text(want[i])!r} "
                    + (f"(a near tie: the reference's gap {gap:.3g})" if ok else f"(the reference's gap {gap:.3g} nats)"))
            break
        deltas.append(abs((lps[i] if lps[i] is not None else np.nan) - rows[i][want[i]]))
    if parted is None and len(toks) < len(want):
        parted, ok, note = len(toks), False, f"the engine stopped after {len(toks)} tokens ({finish}), the reference {len(want)}"
    ok_d, worst, bad = verdict(deltas, a.tolerance, a.allow_outliers)
    if not ok_d:
        note = (note + "; " if note else "") + f"first |delta| over {a.tolerance:g} at step {bad}"
    return row | {"tokens": n_prompt, "new_tokens": len(want), "positions": len(deltas),
                  "top1_agree": len(deltas), "top1_of": len(deltas), "worst": worst, "first_bad": bad,
                  "parted_at": parted, "deltas": [float(x) for x in deltas],
                  "verdict": "pass" if ok and ok_d else "FAIL", "note": note}


def check_vocab(eng, ref, vocab):  # the engine decodes token ids across this checkpoint's vocabulary as it does
    probe = sorted({int(x) for x in np.linspace(3, vocab - 1, 12)} | {100, 1000})
    try:
        pl = eng.prompt_logprobs(probe, 0)
    except BadInput as e:
        raise BadInput(f"the server does not take this checkpoint's token ids ({e})") from None
    wrong = []
    for i, t in enumerate(probe[1:], 1):
        entry = (pl[i] or {}).get(str(t))
        text = ref.text(t)
        if entry is None or "decoded_token" in entry and "\ufffd" not in text and entry["decoded_token"] != text:
            wrong.append((t, text, None if entry is None else entry.get("decoded_token")))
    if wrong:
        t, mine, theirs = wrong[0]
        raise BadInput(f"the checkpoint's vocabulary is not the server's: {len(wrong)} of {len(probe) - 1} probed "
                       f"tokens decode otherwise (token {t}: {mine!r} here, {theirs!r} there)")


def table(rows, out=sys.stdout):
    print(f"{'case':<20} {'positions':>9} {'top-1':>9} {'worst |d|':>10} {'at':>5}  verdict", file=out)
    for r in rows:
        if r["verdict"] == "skip":
            print(f"{r['case']:<20} {'-':>9} {'-':>9} {'-':>10} {'-':>5}  skip ({r['note']})", file=out)
            continue
        at = r["first_bad"] if r["first_bad"] is not None else r.get("parted_at")
        print(f"{r['case']:<20} {r['positions']:>9} {str(r['top1_agree']) + '/' + str(r['top1_of']):>9} "
              f"{r['worst']:>10.3g} {'-' if at is None else at:>5}  {r['verdict']}"
              + (f"  ({r['note']})" if r["note"] else ""), file=out)


def check(a, out=sys.stdout):  # -> the report (dict); bad input raises BadInput / generate.USER_ERRORS
    eng = Engine(a.url, a.api_key, a.timeout)
    eng.pick_model(a.model)
    tok = generate.load_tokenizer(a.ckpt)
    generate.context_of(a.ckpt, a.max_seq_len, a.experts)
    a.parallel = None
    generate.set_device(a)
    ref = Reference(generate.load_model(a), tok)
    vocab = min(tok.get_vocab_size(with_added_tokens=True), ref.model.args.vocab_size)
    check_vocab(eng, ref, vocab)
    rows, t0 = [], time.perf_counter()
    cases = suite(ref.model.args, a.suite)
    unknown = sorted(set(a.case or ()) - {c for c, _, _ in cases})
    if unknown:
        raise BadInput(f"--case {unknown[0]}: not in the {a.suite} suite ({', '.join(c for c, _, _ in cases)})")
    for name, kind, spec in cases:
        if a.case and name not in a.case:
            continue
        rows.append(run_case(name, kind, spec, eng, ref, a, vocab))
    table(rows, out)
    failed = [r["case"] for r in rows if r["verdict"] == "FAIL"]
    worst = max((r["worst"] for r in rows if r["verdict"] != "skip"), default=0.0)
    print(f"{'FAIL: ' + ', '.join(failed) if failed else 'PASS'}: {len(rows)} cases, worst |delta logprob| "
          f"{worst:.3g} (tolerance {a.tolerance:g}), {time.perf_counter() - t0:.1f} s", file=out)
    report = {"url": a.url, "model": eng.model, "ckpt": str(a.ckpt), "suite": a.suite, "tolerance": a.tolerance,
              "allow_outliers": a.allow_outliers, "reference": {"backend": a.backend, "numerics": ref.model.numerics},
              "passed": not failed, "failed": failed, "worst": worst, "cases": rows}
    if a.out is not None:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Exit status: 0 all cases pass; 1 a case fails; 2 bad input, one line 'error: ...'.")
    ap.add_argument("--url", required=True, help="the engine's OpenAI API base URL, e.g. http://127.0.0.1:8000/v1")
    generate.add_model_flags(ap)
    ap.add_argument("--model", default=None, help="the served model's name (default: the one /v1/models lists)")
    ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument("--suite", default="quick", choices=["quick", "full"])
    ap.add_argument("--case", action="append", default=None, help="run only this case of the suite (repeatable)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help=f"largest |delta logprob| (nats) of the actual tokens a case may have (default {TOLERANCE})")
    ap.add_argument("--allow-outliers", type=float, default=0.0,
                    help="the fraction of a case's positions that may exceed --tolerance (default 0)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds any one request may take (default 600)")
    ap.add_argument("--out", default=None, help="a folder for report.json")
    ap.add_argument("--debug", action="store_true", help="on an error, show the Python traceback, not one line")
    a = ap.parse_args(argv)
    try:
        if not (a.tolerance >= 0 and 0 <= a.allow_outliers <= 1):
            raise ValueError("--tolerance must be >= 0 and --allow-outliers in [0, 1]")
        if not Path(a.ckpt).is_dir():
            raise FileNotFoundError(f"--ckpt {a.ckpt}: no such folder")
        report = check(a)
    except (BadInput, *generate.USER_ERRORS) as e:
        if a.debug:
            raise
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
