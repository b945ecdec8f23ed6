"""train.py, first step: the indexer's objectives in torch against the NumPy references (float64),
the data split, the retrieval sequences and the tokenizer."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import chat
import indexer

torch = pytest.importorskip("torch")
import train  # noqa: E402


def draw_case(rng, T, H, S):  # attention rows over the causal keys (zero elsewhere), index scores with ties
    A = rng.random((T, H, S)) * (indexer.causal_ref(T, S - T, S)[:, None, :])
    A = A / A.sum(-1, keepdims=True)
    I = np.round(rng.standard_normal((T, S)), 1)                       # rounded: ties among the scores
    return A, I


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 8), st.integers(1, 10), st.integers(0, 2 ** 31))
def test_objectives_match_the_numpy_references(T, H, past, K, seed):
    rng = np.random.default_rng(seed)
    A, I = draw_case(rng, T, H, past + T)
    dense = train.indexer_kl_dense(torch.from_numpy(A), torch.from_numpy(I))
    sparse = train.indexer_kl_sparse(torch.from_numpy(A), torch.from_numpy(I), K)
    assert abs(float(dense) - indexer.indexer_kl_dense(A, I)) <= 1e-9 * max(1, abs(float(dense)))
    assert abs(float(sparse) - indexer.indexer_kl_sparse(A, I, K)) <= 1e-9 * max(1, abs(float(sparse)))


def test_objectives_train_the_scores_only():
    # the gradient reaches I, not the attention it imitates; at p = softmax(I) the dense loss is 0
    rng = np.random.default_rng(1)
    A, _ = draw_case(rng, 4, 2, 9)
    A_t = torch.from_numpy(A).requires_grad_()
    I = torch.zeros(4, 9, dtype=torch.float64, requires_grad=True)
    train.indexer_kl_dense(A_t, I).backward()
    assert A_t.grad is None and I.grad.abs().sum() > 0
    p = train.attention_target(torch.from_numpy(A))
    assert float(train.indexer_kl_dense(torch.from_numpy(A), torch.log(p.clamp_min(1e-300)))) <= 1e-9


def test_the_split_is_disjoint_and_stable():
    train_files, held = train.stdlib_files(), train.stdlib_files(held_out=True)
    assert train_files and held and not set(train_files) & set(held)
    assert 0.02 <= len(held) / (len(held) + len(train_files)) <= 0.1
    assert all("site-packages" not in str(f) for f in train_files + held)
    assert train.stdlib_files(held_out=True) == held


def test_retrieval_sequences():
    text, key, value = train.retrieval_sequence(3, 500)
    assert text.startswith(f"{key} = {value}\n") and text.endswith(f"print({key})  # {value}\n")
    assert len(text) > 500 and train.retrieval_sequence(3, 500) == (text, key, value)


def test_tokenizer_holds_the_special_tokens():
    tok = train.train_tokenizer(train.read_text(train.stdlib_files()[:20]) + ["def f(x):\n    return x\n"], 600)
    ids = tok.encode(chat.BOS + chat.USER + "def fibonacci(n):" + chat.ASSISTANT + chat.EOS).ids
    assert [tok.id_to_token(i) for i in (ids[0], ids[1], ids[-1])] == [chat.BOS, chat.USER, chat.EOS]
    assert tok.decode(tok.encode("def fibonacci(n):\n    return n\n").ids) == "def fibonacci(n):\n    return n\n"
    assert tok.get_vocab_size() <= 600
