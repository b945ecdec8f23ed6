"""Teaching views of a trained DSA model: what the lightning indexer learns, as PNG figures.

    python views.py --ckpt small-v32 --out figures [--eval eval.json]

1. attention.png   per layer, for one held-out prompt: the main attention p_{t,s} (heads summed,
                   L1-normalised: eq. (3)'s target) beside the index scores I_{t,s} (eq. (1)) with the
                   top-k keys S_t (eq. (2)) marked. What the warm-up teaches: I's top-k covers p's mass.
2. recall.png      the share of p's mass on the indexer's top-k keys against k, per layer, beside the
                   k most recent keys (a sliding window of the same size): the indexer's advantage.
3. context.png     held-out bits per byte against context length, dense and sparse attention, and
                   bzip2 -9 on the same bytes (train.py --evaluate's table, computed here or read).
4. training.png    the training log: the language-model loss of the three stages, the indexer's KL
                   (eq. (3) in the warm-up, eq. (4) in sparse training) and its recall, step by step.

Letters: T query tokens, S keys (here S = T, the prompt attending itself), H heads, k = index_topk.
matplotlib draws (Agg: files only, no display); every number comes from train.py's functions. Without
--eval, view 3 runs train.py's evaluation (minutes on a CPU; a progress bar on stderr tells the time left).
Needs torch and matplotlib: ./setup.sh --views installs them. Exit status: 0 done; 2 bad input or a package
missing, one line; 130 Ctrl-C, one line naming the PNGs this run drew (each written whole) and those it did not.
"""
import json
import sys
from pathlib import Path

import progress

with progress.needs_setup("views.py", "./setup.sh --views", "views: ", active=__name__ == "__main__"):
    import numpy as np

VIEWS = ("attention.png", "recall.png", "context.png", "training.png")   # what main draws, in this order


def attention_maps(model, tokens):  # tokens [T] -> per layer (p [T, S] float64, I [T, S] float64)
    """The dense forward with the indexer recorded: p is eq. (3)'s target, heads summed, L1-normalised."""
    import torch
    import train
    with torch.no_grad():
        _, seen = model(torch.tensor([tokens], device=model.device), record=True)
    return [(train.attention_target(A)[0].double().cpu().numpy(), I[0].double().cpu().numpy()) for A, I in seen]


def top_k_keys(I, K):  # [T, S] scores, the last T keys the queries -> [T, S] bool: S_t = Top-k(I_t), eq. (2)
    import indexer
    T, S = I.shape
    return indexer.topk_select_ref(I[None], K, S - T)[0]


def recall_at(p, sel):  # the mean over queries of p's mass on the selected keys
    return float((p * sel).sum(-1).mean())


def recent_keys(T, S, K):  # [T, S] bool: the K most recent causal keys of each query (a sliding window)
    s, t = np.arange(S)[None, :], np.arange(S - T, S)[:, None]
    return (s <= t) & (s > t - K)


def recall_curves(maps, ks):  # -> {layer: (indexer recall per k, window recall per k)}
    out = {}
    for i, (p, I) in enumerate(maps):
        T, S = p.shape
        out[i] = ([recall_at(p, top_k_keys(I, k)) for k in ks], [recall_at(p, recent_keys(T, S, k)) for k in ks])
    return out


def held_out_prompt(tok, T, files=40):  # -> T tokens from the first held-out file long enough (never trained on)
    import train
    for text in train.read_text(train.evaluation_files())[:files]:
        ids = tok.encode(text).ids
        if len(ids) >= 2 * T:
            return ids[T:2 * T]                                         # past the file's licence header
    raise ValueError(f"no held-out file has {2 * T} tokens")


# -----------------------------------------------------------------------------
# The figures

def row_softmax(I, causal):  # [T, S] -> the indexer's distribution per query over its causal keys (eq. (3)'s q_t)
    z = np.where(causal, I, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def save(fig, path, dpi):  # the PNG whole or not at all (Ctrl-C while it is written leaves no half a file)
    import matplotlib.pyplot as plt
    import checkpoint
    fig.tight_layout()
    checkpoint.write_whole(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)


def plot_attention(maps, K, path):
    import matplotlib.pyplot as plt
    L = len(maps)
    fig, axes = plt.subplots(L, 2, figsize=(8, 4 * L), squeeze=False)
    for i, (p, I) in enumerate(maps):
        T, S = p.shape
        causal = np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]
        sel = top_k_keys(I, K)
        axes[i, 0].imshow(np.log10(np.where(causal, p, np.nan) + 1e-6), cmap="viridis", vmin=-4, vmax=0)
        axes[i, 0].set_title(f"layer {i}: attention p_t (heads summed), log10", fontsize=9)
        axes[i, 1].imshow(np.log10(np.where(causal, row_softmax(I, causal), np.nan) + 1e-6), cmap="magma",
                          vmin=-4, vmax=0)
        axes[i, 1].contour(sel.astype(float), levels=[0.5], colors="cyan", linewidths=0.5)
        axes[i, 1].set_title(f"layer {i}: Softmax(I_t), log10; top-{K} inside cyan; recall {recall_at(p, sel):.2f}",
                             fontsize=9)
        for ax in axes[i]:
            ax.set_xlabel("key s")
            ax.set_ylabel("query t")
    save(fig, path, 70)


def plot_recall(curves, ks, K, path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (idx, win) in curves.items():
        line, = ax.plot(ks, idx, marker="o", ms=3, label=f"layer {i}: indexer top-k")
        ax.plot(ks, win, ls="--", color=line.get_color(), label=f"layer {i}: k most recent keys")
    ax.axvline(K, color="gray", lw=0.8)
    ax.text(K, 0.02, f" index_topk = {K}", color="gray")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1)
    ax.set_xlabel("k (keys kept per query)")
    ax.set_ylabel("share of the attention mass kept (recall)")
    ax.set_title("How much of the dense attention the top-k keeps")
    ax.legend(fontsize=7, ncol=2)
    save(fig, path, 90)


def plot_context(rows, K, window, path):  # rows: train.evaluate's (name, dense, sparse); index_topk; training window
    import matplotlib.pyplot as plt
    ctx = [(int(n.split(" after ")[1].split()[0]), d, s) for n, d, s in rows if n.startswith("bits per byte after")]
    bz = next(d for n, d, s in rows if n.startswith("bzip2"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([c for c, _, _ in ctx], [d for _, d, _ in ctx], marker="o", label="dense attention")
    ax.plot([c for c, _, _ in ctx], [s for _, _, s in ctx], marker="s", ls="--", label="sparse (DSA top-k)")
    ax.axhline(bz, color="gray", ls=":", label="bzip2 -9 on the held-out files, whole")
    for x, name in ((K, f"index_topk {K}"), (window, f"training window {window}")):
        ax.axvline(x, color="gray", lw=0.8)
        ax.text(x, ax.get_ylim()[0], f" {name}", color="gray", rotation=90, va="bottom", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens of context before the scored tokens")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title("Held-out Python source: dense and sparse attention")
    ax.legend()
    save(fig, path, 90)


def plot_training(log, path):  # log: train_log.json's "log" {stage: [step entries]}
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    start = 0
    for stage, entries in log.items():
        x = np.arange(start, start + len(entries))
        for ax, key in zip(axes, ("lm", "kl", "recall")):
            ax.plot(x, [e[key] for e in entries], lw=0.6, label=stage)
        start += len(entries)
    for ax, title in zip(axes, ("language-model loss (nats per token)", "indexer KL: eq. (3) dense, eq. (4) sparse",
                                "recall: dense attention mass on the top-k")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (dense, warm-up, sparse)")
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    save(fig, path, 90)


def fail(message):  # bad input: one line on stderr, exit status 2, before anything is drawn
    print(f"views: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="Draw the teaching views of a checkpoint train.py wrote.")
    ap.add_argument("--ckpt", required=True, help="a folder train.py wrote (config.json, weights, tokenizer.json, "
                                                  "train_log.json)")
    ap.add_argument("--out", required=True, help="folder for the PNGs (created; existing PNGs of these names replaced)")
    ap.add_argument("--eval", help="a JSON file of train.py --evaluate's rows to plot instead of evaluating here")
    ap.add_argument("--tokens", type=int, default=160, help="the prompt's length in tokens for views 1 and 2")
    a = ap.parse_args(argv)
    with progress.needs_setup("views.py", "./setup.sh --views", "views: "):   # one line: what to install
        import matplotlib
        import torch  # noqa: F401
        import tokenizers  # noqa: F401
        import checkpoint  # noqa: F401  (ml_dtypes)
    matplotlib.use("Agg")
    drawn, out = [], Path(a.out)
    try:
        return draw(a, drawn)
    except KeyboardInterrupt:                 # one line: which PNGs in --out are this run's (each whole)
        left = [n for n in VIEWS if n not in drawn]
        old = [n for n in left if (out / n).is_file()]
        said = ([f"{', '.join(drawn)} drawn"] if drawn else []) + ([f"{', '.join(left)} not drawn"] if left else [])
        progress.interrupted(f"in {out}: " + "; ".join(said + ([f"the {', '.join(old)} there from an earlier run"]
                                                                if old else [])))


def draw(a, drawn):  # main's work: the checks, then the views, each name appended to `drawn` once written
    from tokenizers import Tokenizer
    import checkpoint
    import train
    ckpt, out = Path(a.ckpt), Path(a.out)
    for name in ("config.json", "tokenizer.json", "train_log.json"):
        if not (ckpt / name).is_file():
            fail(f"{ckpt / name} is missing (a folder train.py wrote has it)")
    if out.exists() and not out.is_dir():
        fail(f"{out} exists and is not a folder")
    rows = None
    if a.eval:                                                           # checked before anything is drawn
        try:
            rows = [(str(n), float(d), float(s)) for n, d, s in json.loads(Path(a.eval).read_text())]
        except (OSError, ValueError, TypeError) as e:
            fail(f"--eval {a.eval}: not train.py --evaluate's JSON rows ({e})")
    try:
        model = train.TrainModel.from_checkpoint(ckpt).eval()
    except checkpoint.LoadError as e:
        fail(e)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    K = model.args.index_topk
    if not 2 <= a.tokens <= model.args.max_seq_len:
        fail(f"--tokens {a.tokens}: between 2 and the model's max_seq_len {model.args.max_seq_len}")
    out.mkdir(parents=True, exist_ok=True)

    def wrote(name):
        drawn.append(name)
        print(f"views: wrote {out / name}", file=sys.stderr, flush=True)

    maps = attention_maps(model, held_out_prompt(tok, a.tokens))
    plot_attention(maps, K, out / "attention.png")
    wrote("attention.png")
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if k <= a.tokens]
    plot_recall(recall_curves(maps, ks), ks, K, out / "recall.png")
    wrote("recall.png")
    if rows is None:
        print("views: evaluating held-out bits per byte at each context (train.py --evaluate's measure)",
              file=sys.stderr, flush=True)
        rows = train.evaluate(ckpt, n=0, files=None)                    # bits per byte only, no retrieval
    plot_context(rows, K, model.args.original_seq_len, out / "context.png")
    wrote("context.png")
    plot_training(json.loads((ckpt / "train_log.json").read_text())["log"], out / "training.png")
    wrote("training.png")
    return out


if __name__ == "__main__":
    main()
