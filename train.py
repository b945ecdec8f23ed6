"""Training a small model of DeepSeek-V3.2-Exp's architecture from scratch, in the paper's stages
(V3.2-Exp paper §2.1): dense pre-training; a dense warm-up of the lightning indexer alone, eq. (3);
sparse training with top-k selection, eq. (4) for the indexer; then the model written in the real
checkpoint layout, so the loader, both numerics, --verify and the GPU kernels apply to it.

    python train.py --out small-v32 --device cuda      the shipped model's recipe
    python train.py --evaluate small-v32               held-out bits per byte, dense / sparse / bzip2
    python views.py --ckpt small-v32 --out figures     the teaching views (views.py)

TrainModel is model.Transformer's exact forward with autograd (tested equal on its export); the
indexer's objectives are the NumPy references' (indexer.indexer_kl_dense / indexer_kl_sparse) in torch.
The command line's defaults are the shipped model's recipe (tests/test_train.py holds them to its log).

    eq. (3)  L^I = sum_t KL(p_{t,:} || Softmax(I_{t,:}))        p_t: the main attention, heads summed,
                                                                L1-normalised, over the causal keys
    eq. (4)  L^I = sum_t KL(p_{t,S_t} || Softmax(I_{t,S_t}))    S_t = Top-k(I_t), p renormalised on S_t

Data: the Python standard library's own source files (of the interpreter that runs this; a fixed
twentieth of them held out by the hash of their path), and synthetic long-range retrieval sequences
(a key bound early, asked for at the end) from a seeded generator. The tokenizer: byte-level BPE
trained on the training files, holding DeepSeek's special tokens so the chat formats still encode.

Letters: B sequences, T query tokens, S keys (the last T of them are the queries), H heads, k top-k.
"""
import hashlib
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

try:
    import torch
except ImportError:                        # --help still works; main() names the set-up command
    torch = None

import chat
import progress
from progress import Progress

SPECIAL = [chat.BOS, chat.EOS, chat.USER, chat.ASSISTANT, chat.THINK, chat.END_THINK, chat.CALLS_BEGIN,
           chat.CALLS_END, chat.CALL_BEGIN, chat.CALL_END, chat.TOOL_SEP, chat.OUTPUT_BEGIN, chat.OUTPUT_END]


# -----------------------------------------------------------------------------
# The data: the standard library's source, split by path; synthetic retrieval

def stdlib_files(held_out=False, root=None):  # -> the .py files of one side of the split, sorted
    """The standard library of this interpreter (site-packages and test suites left out: other code and
    generated data), a file held out iff the first byte of sha256(its relative path) is below 13 (~1/20)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        if (hashlib.sha256(rel.encode()).digest()[0] < 13) == held_out:
            out.append(f)
    return out


GENERATED = ("encodings/", "pydoc_data/")    # codec tables and a docstring dump, written by scripts: not in evaluations


def evaluation_files():  # -> the held-out files that people wrote (GENERATED left out: they flatter any model)
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in stdlib_files(held_out=True, root=root) if not f.relative_to(root).as_posix().startswith(GENERATED)]


def read_text(files):  # -> the files' text, each as UTF-8 (a file that is not is skipped)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def retrieval_sequence(seed, distance, queries=1):  # -> (text, key, value): a key bound, then asked for
    """A name bound to a value on the first line, `distance` characters of Python-like filler (other
    bindings), then a line asking for it: the answer is the value, found only by attending that far.
    queries > 1 (training): that many more lines after it ask for other bindings, drawn from all of them."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))  # noqa: E731
    key, value = word(), str(rng.randint(10000, 99999))
    lines, size, bound = [f"{key} = {value}\n"], 0, []
    while size < distance:
        other = (word(), rng.randint(0, 99999))
        line = f"{other[0]} = {other[1]}\n"                               # other bindings: distractors
        lines.append(line)
        bound.append(other)
        size += len(line)
    lines.append(f"print({key})  # {value}\n")
    for _ in range(queries - 1):
        k, v = rng.choice(bound)
        lines.append(f"print({k})  # {v}\n")
    return "".join(lines), key, value


def train_tokenizer(texts, vocab_size=4096):  # -> a tokenizers.Tokenizer: byte-level BPE + DeepSeek's specials
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


# -----------------------------------------------------------------------------
# eqs. (3)-(4): the indexer's objectives, differentiable in the index scores I

def attention_target(A):  # [..., T, H, S] attention probabilities -> p [..., T, S]: heads summed, L1-normalised
    a = A.sum(-2)
    return a / a.sum(-1, keepdim=True)


def _kl(p, I, allowed):  # sum over t of KL(p_t || softmax(I_t over the allowed keys)); 0 log 0 = 0
    log_q = torch.log_softmax(I.masked_fill(~allowed, -float("inf")), -1)
    terms = torch.where(allowed & (p > 0), p * (torch.log(torch.where(p > 0, p, 1)) - log_q.masked_fill(~allowed, 0)), 0)
    return terms.sum()


def causal(T, S, device=None):  # [T, S]: the last T of S keys are the queries; key s visible to query t iff s <= S - T + t
    return torch.arange(S, device=device)[None, :] <= (S - T + torch.arange(T, device=device))[:, None]


def indexer_kl_dense(A, I):  # eq. (3): [..., T, H, S], [..., T, S] -> the summed KL (indexer.indexer_kl_dense)
    """A is the target (no gradient flows into the main attention: detached); the gradient reaches I."""
    T, S = I.shape[-2:]
    allowed = causal(T, S, I.device).expand(I.shape)
    p = torch.where(allowed, attention_target(A.detach()), 0)
    return _kl(p, I, allowed)


def topk_mask(I, K):  # [..., T, S] -> bool: S_t = Top-k(I_t) among the causal keys, ties to the lower index
    T, S = I.shape[-2:]
    c = causal(T, S, I.device)
    order = torch.sort(-I.detach().masked_fill(~c, -float("inf")), dim=-1, stable=True).indices[..., :min(K, S)]
    return torch.zeros(I.shape, dtype=torch.bool, device=I.device).scatter_(-1, order, True) & c


def indexer_kl_sparse(A, I, K):  # eq. (4): the KL over the selected keys S_t = Top-k(I_t) (indexer.indexer_kl_sparse)
    """Top-k of the causal keys, ties toward the lower index (as indexer.topk_select_ref); the target p
    renormalised on S_t."""
    sel = topk_mask(I, K)
    p = torch.where(sel, attention_target(A.detach()), 0)
    p = p / p.sum(-1, keepdim=True)
    return _kl(p, I, sel)


# -----------------------------------------------------------------------------
# The model in training: DeepSeek-V3.2-Exp's forward in float32 with autograd, its parameters under the
# checkpoint's own (Hugging Face) names, so that export writes the layout model.py loads

class TrainModel(torch.nn.Module if torch else object):     # (object: without torch, for --help)
    """The exact-numerics forward of model.Transformer (embedding, MLA under DSA with the lightning
    indexer, MoE, head) over a whole sequence from position 0, differentiable, also returning per layer
    the main attention's probabilities summed over heads (eq. (3)'s target) and the index scores I."""

    def __init__(self, cfg, seed=0):
        import checkpoint
        import config
        import quant
        import rope
        super().__init__()
        self.args = config.ModelArgs.from_config(cfg)
        a = self.args
        self.freqs = torch.from_numpy(rope.yarn_freqs(a.qk_rope_head_dim, a.rope_theta, a.max_seq_len, a.original_seq_len,
                                                      a.rope_factor, a.rope_scaling.get("beta_fast", 32),
                                                      a.rope_scaling.get("beta_slow", 1)))
        drawn = checkpoint.random_weights(cfg, seed)                     # the bundled checkpoints' draw, in fp32
        params = {}
        for name, t in drawn.items():
            if name.endswith("weight_scale_inv"):
                continue
            scale = drawn.get(name[:-len("weight")] + "weight_scale_inv") if name.endswith(".weight") else None
            value = quant.weight_dequant(t, scale) if scale is not None else quant.decode(t)
            params[name.replace(".", "__")] = torch.nn.Parameter(torch.from_numpy(value.astype("float32")))
        self.p = torch.nn.ParameterDict(params)
        self.dropout = 0.0                                               # residual dropout, in training only
        self.loads = {}                                                  # MoE layer -> tokens per expert, last step

    @classmethod
    def from_checkpoint(cls, path):  # a checkpoint this model exported (or any in the layout) -> its weights, fp32
        import checkpoint
        import quant
        ck = checkpoint.Checkpoint(path)
        m = cls(json.loads((Path(path) / "config.json").read_text()))
        with torch.no_grad():
            for key, prm in m.p.items():
                name = key.replace("__", ".")
                W = ck.weight(name[:-len(".weight")]) if name.endswith(".weight") else quant.Weight(ck.get(name), None)
                prm.copy_(torch.tensor(W.dequant()))
        return m

    def w(self, name):
        return self.p[name.replace(".", "__")]

    @property
    def device(self):
        return self.p["model__embed_tokens__weight"].device

    def balance(self, gamma):  # DeepSeek-V3 §2.1.2: auxiliary-loss-free load balancing of the router bias
        """After a step: b_i += gamma if expert i took fewer tokens than the mean, -= gamma if more (the
        bias only chooses experts; it never weights them)."""
        with torch.no_grad():
            for i, load in self.loads.items():
                b = self.p[f"model__layers__{i}__mlp__gate__e_score_correction_bias"]
                b += gamma * torch.sign(load.float().mean() - load.float())

    def forward(self, tokens, sparse=False, record=False, detach_indexer=False):  # tokens [B, T] -> logits [B, T, V] (and per layer A, I)
        """detach_indexer (the sparse stage): the indexer's inputs cut from the graph, so its loss trains
        it alone and the language-model loss does not reach it through the selection."""
        import backend_torch as bt
        import rope
        a = self.args
        B, T = tokens.shape
        H, N, R, V, C = a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        J, D, eps = a.index_n_heads, a.index_head_dim, a.rms_norm_eps
        dev = tokens.device
        cos, sin = (torch.from_numpy(x).to(dev) for x in rope.rope_angles(self.freqs.numpy(), range(T)))
        causal_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        drop = lambda y: torch.nn.functional.dropout(y, self.dropout, self.training) if self.dropout else y  # noqa: E731
        h, seen = drop(self.w("model.embed_tokens.weight")[tokens]), []
        for i in range(a.num_hidden_layers):
            pre, at = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            x = bt.rms_norm(h, self.w(pre + "input_layernorm.weight"), eps, bt.no_round)
            qr = bt.rms_norm(x @ self.w(at + "q_a_proj.weight").T, self.w(at + "q_a_layernorm.weight"), eps, bt.no_round)
            q = (qr @ self.w(at + "q_b_proj.weight").T).view(B, T, H, N + R)
            q_nope, q_pe = q[..., :N], bt.rope_interleaved(q[..., N:], cos, sin)             # MLA: rope last
            kv = x @ self.w(at + "kv_a_proj_with_mqa.weight").T
            c_kv = bt.rms_norm(kv[..., :C], self.w(at + "kv_a_layernorm.weight"), eps, bt.no_round)
            k_pe = bt.rope_interleaved(kv[:, :, None, C:], cos, sin)[:, :, 0]               # [B, T, R]
            kvb = (c_kv @ self.w(at + "kv_b_proj.weight").T).view(B, T, H, N + V)
            # the lightning indexer, eq. (1), in exact numerics (no rotation, unit scales)
            xi, qri = (x.detach(), qr.detach()) if detach_indexer else (x, qr)
            qi = (qri @ self.w(at + "indexer.wq_b.weight").T).view(B, T, J, D)
            qi = torch.cat([bt.rope_half_split(qi[..., :R], cos, sin), qi[..., R:]], -1)     # rope FIRST here
            ki = bt.layer_norm(xi @ self.w(at + "indexer.wk.weight").T, self.w(at + "indexer.k_norm.weight"),
                               self.w(at + "indexer.k_norm.bias"))
            ki = torch.cat([bt.rope_half_split(ki[:, :, None, :R], cos, sin)[:, :, 0], ki[..., R:]], -1)
            wi = (xi @ self.w(at + "indexer.weights_proj.weight").T) * (J ** -0.5 * D ** -0.5)
            I = bt.index_scores(qi, wi, ki, torch.ones(B, T, device=dev))                     # [B, T, T]
            allowed = causal_mask[None].expand(B, T, T)
            if sparse:                                                                        # eq. (2)
                allowed = bt.topk_select(I.detach(), a.index_topk, 0)
            qq = torch.cat([q_nope, q_pe], -1).transpose(1, 2)                                # [B, H, T, N + R]
            kk = torch.cat([kvb[..., :N], k_pe[:, :, None].expand(B, T, H, R)], -1).transpose(1, 2)
            s = (qq @ kk.transpose(-1, -2)) * a.softmax_scale
            p = torch.softmax(s.masked_fill(~allowed[:, None], -float("inf")), -1)           # [B, H, T, T]
            o = (p @ kvb[..., N:].transpose(1, 2)).transpose(1, 2).reshape(B, T, H * V)
            h = h + drop(o @ self.w(at + "o_proj.weight").T)
            if record:
                seen.append((p.transpose(1, 2), I))                                           # A [B, T, H, S], I
            x = bt.rms_norm(h, self.w(pre + "post_attention_layernorm.weight"), eps, bt.no_round)
            h = h + drop(self._ffn(x.reshape(B * T, -1), i).view(B, T, -1))
        h = bt.rms_norm(h, self.w("model.norm.weight"), eps, bt.no_round)
        logits = h @ self.w("lm_head.weight").T
        return (logits, seen) if record else logits

    def _ffn(self, x, i):  # [M, d] -> [M, d]: the dense MLP, or the routed experts and the shared one
        a, m = self.args, f"model.layers.{i}.mlp."

        def mlp(prefix, y):
            return (torch.nn.functional.silu(y @ self.w(prefix + "gate_proj.weight").T)
                    * (y @ self.w(prefix + "up_proj.weight").T)) @ self.w(prefix + "down_proj.weight").T
        if i < a.first_k_dense_replace:
            return mlp(m, x)
        import backend_torch as bt
        bias = self.p[(m + "gate.e_score_correction_bias").replace(".", "__")].detach()
        w, idx = bt.gate(x, self.w(m + "gate.weight"), bias, a)
        self.loads[i] = torch.bincount(idx.reshape(-1), minlength=a.n_routed_experts)   # for balance()
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():                             # expert-id order, as the references
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            out = out.index_add(0, tok, mlp(m + f"experts.{e}.", x[tok]) * w[tok, slot, None])
        return out + mlp(m + "shared_experts.", x)

    def export(self, path, cfg, fp8=True, extra_files=None, force=False):  # -> the checkpoint folder, real layout
        """FP8 linears, bf16 rest, + extra files {name: text}, written at once under train.py's marker (which
        only --force replaces): an existing non-empty `path` is refused (FileExistsError) unless force."""
        import checkpoint
        import quant
        out = {}
        for key, prm in self.p.items():
            name, value = key.replace("__", "."), prm.detach().numpy()
            if fp8 and value.ndim == 2 and not any(k in name for k in ("embed_tokens", "lm_head", "mlp.gate.",
                                                                      "weights_proj")):
                out[name], out[name.replace(".weight", ".weight_scale_inv")] = quant.weight_quant(value)
            elif value.ndim == 2 or not fp8:
                out[name] = quant.round_once(value.astype("float64"), quant.BF16)
            else:
                out[name] = value.astype("float32")                      # norms and biases: F32
        return checkpoint.write_checkpoint(path, cfg, out, extra_files=extra_files, kind="trained", force=force)


# -----------------------------------------------------------------------------
# The stages: which parameters learn, from which loss

STAGES = ("dense", "warmup", "sparse")


def trainable(model, stage):  # -> the parameter names a stage trains
    """dense: everything but the indexer (nothing asks anything of it yet); warmup: the indexer alone,
    the rest frozen (eq. (3)); sparse: everything, the indexer by eq. (4) only (its inputs detached)."""
    idx = {k for k in model.p if "__indexer__" in k}
    bias = {k for k in model.p if k.endswith("e_score_correction_bias")}       # set by balancing, not by gradient
    return idx if stage == "warmup" else (set(model.p) - bias - (idx if stage == "dense" else set()))


def recall(A, I, K):  # the share of the main attention's mass (heads summed) on the indexer's top-k keys
    return float((attention_target(A.detach()) * topk_mask(I, K)).sum(-1).mean())


def step_loss(model, tokens, stage):  # -> (loss to minimise, log: language-model loss, indexer KL, recall)
    K = model.args.index_topk
    logits, seen = model(tokens, sparse=stage == "sparse", record=True, detach_indexer=stage == "sparse")
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    n = tokens.shape[0] * tokens.shape[1]
    kl = sum((indexer_kl_sparse(A, I, K) if stage == "sparse" else indexer_kl_dense(A, I)) for A, I in seen) / n
    if stage == "sparse":                               # recall against the dense attention, not the sparse one
        with torch.no_grad():                           # (whose mass lies on the selected keys by construction)
            seen = model(tokens, record=True)[1]
    log = {"lm": float(lm.detach()), "kl": float(kl.detach()), "recall": sum(recall(A, I, K) for A, I in seen) / len(seen)}
    return (kl if stage == "warmup" else lm + (kl if stage == "sparse" else 0)), log


def learning_rate(lr, i, n, warm=50):  # step i of n: linear warm-up over `warm` steps, then cosine to lr / 10
    import math
    if i < warm:
        return lr * (i + 1) / warm
    return lr * (0.55 + 0.45 * math.cos(math.pi * (i - warm) / max(1, n - warm)))


def run_stage(model, batches, stage, lr=1e-3, progress=None, gamma=1e-3, decay=0.1):  # -> the log of every step
    """One stage over `batches` ([B, T] token tensors), AdamW on the stage's parameters (warm-up, cosine
    decay, gradients clipped to norm 1, weight decay on the matrices); the router bias balanced after each step of the stages that train
    the experts (gamma: its step, DeepSeek-V3's 0.001)."""
    names = trainable(model, stage)
    for k, prm in model.p.items():
        prm.requires_grad_(k in names)
    params = [model.p[k] for k in sorted(names)]
    opt = torch.optim.AdamW([{"params": [q for q in params if q.ndim == 2], "weight_decay": decay},
                             {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}], lr=lr)
    logs = []
    for i, tokens in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = learning_rate(lr, i, len(batches))
        loss, log = step_loss(model, tokens, stage)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if stage != "warmup":
            model.balance(gamma)
        logs.append(log)
        if progress:
            progress(stage, i + 1, len(batches), log)
    return logs


# -----------------------------------------------------------------------------
# The recipe: data -> tokenizer -> the three stages -> a checkpoint in the real layout

def token_batches(ids, n, B, T, seed):  # n batches of B windows of T tokens from one token stream, seeded
    g = torch.Generator().manual_seed(seed)
    ids = torch.as_tensor(ids)
    starts = torch.randint(0, len(ids) - T, (n, B), generator=g)
    return [torch.stack([ids[s:s + T] for s in row.tolist()]) for row in starts]


def corpus_ids(tok, texts, seed, retrieval_share=0.1, distances=(100, 1200), queries=1):  # -> one token stream
    """The files, each closed by EOS, with retrieval sequences mixed in between them until they make
    `retrieval_share` of the tokens; each sequence's distance (characters) drawn from `distances`, so
    that most fit a training window while reaching well beyond the top-k; `queries` lines ask for bindings."""
    rng = random.Random(seed)
    eos = tok.token_to_id(chat.EOS)
    ids, extra, k = [], 0, 0
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
        while extra < retrieval_share * len(ids):                        # synthetic sequences mixed in
            seq = tok.encode(retrieval_sequence(seed * 1_000_003 + k, rng.randint(*distances), queries)[0]).ids + [eos]
            ids += seq
            extra, k = extra + len(seq), k + 1
    return ids


def small_config(vocab_size, seq, **overrides):  # the shipped model's config: tiny-v32's shapes, 4 layers, top-64
    """hidden 256, 4 heads of MLA (ranks 128), the indexer's 16 heads of 128, 8 routed experts (2 a token, in
    4 groups) and a shared one, the first layer dense; index_topk 64 (an eighth of the training window); YaRN
    off within the training window (original = seq), factor 4 beyond it."""
    import checkpoint
    cfg = checkpoint.tiny_config(vocab_size=vocab_size, num_hidden_layers=4, index_topk=64,
                                 max_position_embeddings=4 * seq)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=4.0, original_max_position_embeddings=seq)
    cfg.update(overrides)
    return cfg


def parser():  # the command line; its defaults are the shipped model's recipe (tested against its log)
    import argparse
    ap = argparse.ArgumentParser(description="Train a small DeepSeek-V3.2-Exp-architecture model in the paper's "
                                             "three stages and write it in the real checkpoint layout.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="train, and write the checkpoint to this folder (new or empty; --force "
                                    "replaces a non-empty one)")
    what.add_argument("--evaluate", metavar="CKPT", help="evaluate a checkpoint this wrote: held-out bits per byte "
                                                         "(dense, sparse, bzip2) and retrieval accuracy")
    ap.add_argument("--steps", type=int, nargs=3, default=[2500, 400, 1000], metavar=("DENSE", "WARMUP", "SPARSE"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (above index_topk: sparse selects)")
    ap.add_argument("--topk", type=int, default=64, help="index_topk: the keys each query attends in sparse mode")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--files", type=int, default=None, help="use only the first N files (toy runs, the evaluation)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dropout", type=float, default=0.3, help="residual dropout in training (embedding, attention "
                                                                "and FFN outputs)")
    ap.add_argument("--queries", type=int, default=1, help="lines asking for a binding in each retrieval sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=32, help="--evaluate: retrieval sequences per distance")
    ap.add_argument("--json", help="--evaluate: also write the rows to this JSON file (views.py --eval reads it)")
    ap.add_argument("--windows", type=int, default=128, help="--evaluate: scored blocks of 64 tokens per context")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a GPU trains with TF32 matrix products)")
    ap.add_argument("--force", action="store_true", help="--out: replace the folder even if it is not empty (a "
                                                         "checkpoint trained earlier, files of yours: deleted)")
    return ap


def fail(message):  # one line on stderr and exit 2, without argparse's usage lines or a traceback
    print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None):
    ap = parser()
    a = ap.parse_args(argv)
    if torch is None:
        fail("torch is not installed in this Python: run ./setup.sh --torch (its CPU build; ./setup.sh --tests "
             "installs everything)")
    with progress.needs_setup("train.py", "./setup.sh --torch", "train.py: error: "):   # before any work
        import checkpoint  # noqa: F401  (ml_dtypes)
        import tokenizers  # noqa: F401  (the tokenizer's training and the evaluation)
    try:
        return run(ap, a)
    except KeyboardInterrupt:                         # Ctrl-C: one line; what is written is whole or absent
        progress.interrupted("the rows so far are printed above" + (f"; --json {a.json} is written only once all "
                                                                     "are done" if a.json else "") if a.evaluate else
                             f"no half-written checkpoint in {a.out}: it is written whole, at the end")


def run(ap, a):  # main's work once the flags are parsed and the packages are here
    import checkpoint
    if a.evaluate:
        missing = [n for n in ("config.json", "tokenizer.json") if not (Path(a.evaluate) / n).is_file()]
        if missing:
            ap.error(f"--evaluate {a.evaluate}: no {missing[0]} there (a folder train.py wrote has it)")
        if (a.files is not None and a.files < 1) or a.samples < 0 or a.windows < 1:
            ap.error("--files and --windows must be positive, --samples at least 0")
        if a.json and not Path(a.json).resolve().parent.is_dir():
            ap.error(f"--json {a.json}: its folder does not exist")
        return evaluate(a.evaluate, n=a.samples, files=a.files, out=a.json, windows=a.windows)
    if min(a.steps) < 1 or a.batch < 1 or a.seq < 2 or a.topk < 1 or (a.files is not None and a.files < 1):
        ap.error("--steps, --batch, --seq, --topk and --files must be positive (--seq at least 2)")
    if not 0 <= a.dropout < 1:
        ap.error(f"--dropout {a.dropout}: a probability below 1 expected")
    try:
        checkpoint.check_device(a.device)
        checkpoint.check_replaceable(Path(a.out), "trained", a.force)     # before any training, not after
    except (ValueError, FileExistsError, NotADirectoryError) as e:
        fail(e)
    prior = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True   # training's GEMMs in tf32
    try:
        return train(a)
    finally:                                          # set back: a caller's fp32 GEMMs stay fp32 (the tests')
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prior


def train(a):  # the recipe of main's arguments -> the checkpoint written
    t0 = time.time()
    files = stdlib_files()[:a.files]
    texts = read_text(files)
    tok = train_tokenizer(texts, a.vocab)
    ids = corpus_ids(tok, texts, a.seed, queries=a.queries)
    print(f"data: {len(files)} files, {len(ids):,} tokens, vocabulary {tok.get_vocab_size()} "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    cfg = small_config(tok.get_vocab_size(), a.seq, index_topk=a.topk, bos_token_id=tok.token_to_id(chat.BOS),
                       eos_token_id=tok.token_to_id(chat.EOS))
    model = TrainModel(cfg, a.seed).to(a.device)
    model.dropout = a.dropout
    log, seconds, held = {}, {"data": time.time() - t0}, {}
    held_docs, sc = encode_ids(tok, read_text(evaluation_files())), min(64, a.seq // 2)

    def held_bpb(sparse, n):  # held-out bits per byte of `sc` tokens after seq - sc of context (one window)
        return bits_per_byte(model.eval(), tok, held_docs, a.seq - sc, sparse, max_windows=n, scored=sc)

    def progress(stage, i, n, entry):
        if i % max(1, n // 10) == 0:                                    # the held-out curve, dense attention
            entry["held_out"] = held_bpb(False, 32)
            model.train()
        bar.update(i, f"lm {entry['lm']:.3f}  kl {entry['kl']:.4f}  recall {entry['recall']:.3f}")
    for stage, n in zip(STAGES, a.steps):
        t1 = time.time()
        batches = [b.to(a.device) for b in token_batches(ids, n, a.batch, a.seq, a.seed + len(log))]
        model.train()
        bar = Progress(n, f"{stage:>6}")
        log[stage] = run_stage(model, batches, stage, a.lr, progress)
        bar.close()
        seconds[stage] = time.time() - t1
        held[stage] = {mode: held_bpb(mode == "sparse", 64)
                       for mode in ("dense", "sparse")}                 # held-out bits per byte after the stage
        print(f"{stage:>6} done in {seconds[stage]:.0f} s; held-out bits per byte: dense {held[stage]['dense']:.3f}, "
              f"sparse {held[stage]['sparse']:.3f}", file=sys.stderr, flush=True)
    where = {"python": sys.version.split()[0], "torch": torch.__version__, "device":
             torch.cuda.get_device_name() if str(a.device).startswith("cuda") else "cpu", "tokens": len(ids),
             "files": len(files), "date": time.strftime("%Y-%m-%d")}
    train_log = json.dumps({"args": vars(a), "where": where, "seconds": seconds, "held_out_bits_per_byte": held,
                            "log": log})
    out = model.cpu().export(Path(a.out), cfg, extra_files={"tokenizer.json": tok.to_str(), "train_log.json": train_log},
                             force=a.force)
    print(f"wrote {out} in {time.time() - t0:.0f} s", file=sys.stderr)
    return out


def evaluate(ckpt, n, files, out=None, windows=128):  # -> the rows printed: the evaluation's table for one checkpoint
    """Held-out bits per byte after contexts from half index_topk to 8 times it (the training window) and 16
    times (YaRN beyond it), dense and sparse, the same scored tokens at every context; bzip2 -9 on the
    whole held-out files that hold them; retrieval accuracy over n fresh sequences at distances (characters)
    from within the top-k's reach to the training window's (n = 0: none). Rows printed as they come; `out`:
    also written there as JSON (views.py plots them). A progress bar with the time left on stderr."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(ckpt) / "tokenizer.json"))
    model = TrainModel.from_checkpoint(ckpt).eval()
    K, top = model.args.index_topk, model.args.max_seq_len
    held = read_text(evaluation_files())[:files]
    print(f"{ckpt}: index_topk {K}, {len(held)} held-out files; columns: dense, sparse", flush=True)
    rows = []

    def row(name, dense, sparse):
        rows.append((name, dense, sparse))
        bar.clear()
        print(f"{name:55s} {dense:8.3f} {sparse:8.3f}", flush=True)
    docs = encode_ids(tok, held)
    contexts = [c for c in (K // 2, K, 4 * K, 8 * K, 16 * K) if 1 <= c and c + 64 <= top]
    scored = {T: len(score_blocks(docs, max(contexts), windows)) for T in contexts}      # the same blocks at every T
    distances = (50, 200, 800) if n else ()
    steps = [(2 * scored[T], forward_cost(T + 64)) for T in contexts] + [(2 * n, retrieval_cost(d)) for d in distances]
    bar = Progress(sum(k for k, _ in steps), "evaluating", sum(k * cost for k, cost in steps))

    def tick(cost):  # one window or retrieval sequence done, of this estimated cost
        bar.update(bar.done + 1, work=bar.work + cost)
    bz = bzip2_bits_per_byte(held)
    row("bzip2 -9, bits per byte (the held-out files, whole)", bz, bz)
    for T in contexts:
        row(f"bits per byte after {T} tokens", *(bits_per_byte(model, tok, docs, T, sparse, windows,
                                                               context_max=max(contexts), tick=tick)
                                                 for sparse in (False, True)))
    for dist in distances:
        row(f"retrieval accuracy at {dist} characters", *(retrieval_accuracy(model, tok, dist, n, sparse, tick=tick)
                                                          for sparse in (False, True)))
    bar.close()
    if out:
        import checkpoint
        checkpoint.write_whole(out, lambda tmp: tmp.write_text(json.dumps(rows, indent=1) + "\n"))
    return rows


# -----------------------------------------------------------------------------
# Evaluation: held-out bits per byte, dense and sparse, beside bzip2; retrieval accuracy against distance

def score_blocks(docs, C, max_windows=128, scored=64, per_file=8):  # -> [(ids, p)]: the blocks bits_per_byte scores
    """In each document, up to `per_file` consecutive blocks of `scored` tokens from position C on; up to
    max_windows blocks in all."""
    blocks = [(ids, p) for ids in docs for p in list(range(C, len(ids) - scored + 1, scored))[:per_file]]
    return blocks[:max_windows]


def bits_per_byte(model, tok, docs, T, sparse, max_windows=128, scored=64, context_max=None, per_file=8, tick=None):
    """Held-out bits per byte, the same scored tokens for every context T: the blocks of `scored` tokens
    of score_blocks (from position C = context_max, default T, in each document: its token ids, encode_ids),
    each predicted after the T tokens before it (one window of T + scored tokens, its last `scored`
    positions scored). The next-token cross-entropy in bits over the UTF-8 bytes the blocks spell.
    tick(cost): told after each window, with its forward_cost."""
    import math
    bits, nbytes = 0.0, 0
    for ids, p in score_blocks(docs, context_max or T, max_windows, scored, per_file):
        w = torch.tensor([ids[p - T:p + scored]], device=getattr(model, "device", None))
        with torch.no_grad():
            logits = model(w, sparse=sparse)[0, T - 1:-1]                # the predictions of ids[p:p + scored]
        ce = torch.nn.functional.cross_entropy(logits.float(), w[0, T:], reduction="sum").cpu()
        bits += float(ce) / math.log(2)
        nbytes += len(tok.decode(ids[p:p + scored]).encode("utf-8"))
        if tick:
            tick(forward_cost(T + scored))
    return bits / max(nbytes, 1)


def forward_cost(tokens):  # a forward's time, in units of about one token's, for the progress bar's estimate
    return tokens * (1 + tokens / 512)                                   # linear layers, attention's T^2


def retrieval_cost(distance):  # a retrieval sequence's estimated forward_cost: a few forwards of its prompt
    return 3 * forward_cost(30 + distance // 3)


def encode_ids(tok, texts):  # -> each text's token ids, encoded once (in parallel) for every measure
    return [e.ids for e in tok.encode_batch(texts)]


def bzip2_bits_per_byte(texts):  # the same held-out text through bzip2 (level 9)
    import bz2
    raw = "".join(texts).encode("utf-8")
    return 8 * len(bz2.compress(raw, 9)) / len(raw)


def retrieval_accuracy(model, tok, distance, n, sparse, seed=10_000, tick=None):  # share of fresh sequences answered right
    """Greedy continuation after 'print(key)  #': right iff it spells ' ' and the bound value's digits (the
    space left to the continuation, where byte-level BPE puts it: on the value's first token). tick(cost):
    told after each sequence, with retrieval_cost(distance)."""
    right = 0
    for k in range(n):
        text, key, value = retrieval_sequence(seed + k, distance)
        prompt = tok.encode(text[:-len(value) - 2]).ids
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(tok.encode(" " + value).ids)):
                ids.append(int(model(torch.tensor([ids], device=model.device), sparse=sparse)[0, -1].argmax()))
        right += tok.decode(ids[len(prompt):]).strip().startswith(value)
        if tick:
            tick(retrieval_cost(distance))
    return right / n


if __name__ == "__main__":
    main()
