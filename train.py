"""Training a small model of DeepSeek-V3.2-Exp's architecture from scratch, in the paper's stages
(V3.2-Exp paper §2.1): dense pre-training; a dense warm-up of the lightning indexer alone, eq. (3);
sparse training with top-k selection, eq. (4) for the indexer. Issue 21, first step: the data every
machine holds, the tokenizer, and the indexer's two objectives in torch (the NumPy references are
indexer.indexer_kl_dense / indexer_kl_sparse). The model, the stages and the shipped checkpoint follow.

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
import random
import sysconfig
from pathlib import Path

import torch

import chat

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


def read_text(files):  # -> the files' text, each as UTF-8 (a file that is not is skipped)
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def retrieval_sequence(seed, distance):  # -> (text, key, value): a key bound, then asked for
    """A name bound to a value on the first line, `distance` characters of Python-like filler (other
    bindings), then a line asking for it: the answer is the value, found only by attending that far."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))  # noqa: E731
    key, value = word(), str(rng.randint(10000, 99999))
    lines, size = [f"{key} = {value}\n"], 0
    while size < distance:
        line = f"{word()} = {rng.randint(0, 99999)}\n"                     # other bindings: distractors
        lines.append(line)
        size += len(line)
    lines.append(f"print({key})  # {value}\n")
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


def indexer_kl_sparse(A, I, K):  # eq. (4): the KL over the selected keys S_t = Top-k(I_t) (indexer.indexer_kl_sparse)
    """Top-k of the causal keys, ties toward the lower index (as indexer.topk_select_ref); the target p
    renormalised on S_t."""
    T, S = I.shape[-2:]
    c = causal(T, S, I.device)
    masked = I.detach().masked_fill(~c, -float("inf"))
    order = torch.sort(-masked, dim=-1, stable=True).indices[..., :min(K, S)]
    sel = torch.zeros(I.shape, dtype=torch.bool, device=I.device).scatter_(-1, order, True) & c
    p = torch.where(sel, attention_target(A.detach()), 0)
    p = p / p.sum(-1, keepdim=True)
    return _kl(p, I, sel)
