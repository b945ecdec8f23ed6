"""views.py: the teaching views' numbers against independent computations (the NumPy top-k reference,
train.py's torch recall), and the four PNGs drawn from a toy checkpoint that train.py wrote."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import indexer
from conftest import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")
import train  # noqa: E402
import views  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(0, 9), st.integers(1, 12), st.integers(0, 2 ** 31))
def test_top_k_and_recall_match_the_references(T, past, K, seed):
    rng = np.random.default_rng(seed)
    S = past + T
    I = np.round(rng.standard_normal((T, S)), 1).astype(np.float32)       # rounded: ties among the scores
    sel = views.top_k_keys(I, K)                                          # the NumPy reference's mask
    A = rng.random((T, 3, S)) * indexer.causal_ref(T, past, S)[:, None, :]
    A = A / A.sum(-1, keepdims=True)
    p = train.attention_target(torch.from_numpy(A)).numpy()
    want = train.recall(torch.from_numpy(A), torch.from_numpy(I.astype(np.float64)), K)
    assert abs(views.recall_at(p, sel) - want) <= 1e-12


@given(st.integers(1, 9), st.integers(0, 9), st.integers(1, 12))
def test_recent_keys_are_a_sliding_window(T, past, K):
    win = views.recent_keys(T, past + T, K)
    for t in range(T):
        q = past + t                                                      # the query's own position
        assert list(np.nonzero(win[t])[0]) == list(range(max(0, q - K + 1), q + 1))


def test_row_softmax_is_the_indexers_distribution():
    I = np.array([[1.0, 5.0, 2.0], [0.5, -1.0, 3.0]])
    causal = np.array([[True, False, False], [True, True, True]])
    got = views.row_softmax(I, causal)
    assert np.allclose(got[0], [1, 0, 0]) and np.allclose(got[1], np.exp(I[1]) / np.exp(I[1]).sum())


@pytest.mark.slow
def test_the_four_views_of_a_toy_checkpoint(tmp_path, capsys):
    out = train.main(["--out", str(tmp_path / "m"), "--steps", "2", "2", "2", "--batch", "2", "--seq", "48", "--topk", "8",
                      "--vocab", "400", "--files", "3"])
    rows = train.evaluate(out, n=0, files=2, out=tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text()) == [list(r) for r in rows]
    figs = views.main(["--ckpt", str(out), "--out", str(tmp_path / "fig"), "--eval", str(tmp_path / "eval.json"),
                       "--tokens", "40"])
    for name in ("attention", "recall", "context", "training"):
        assert (figs / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    (tmp_path / "bad.json").write_text('{"not": "rows"}')
    capsys.readouterr()                                                  # (what training and drawing said)
    for argv, said in ((["--eval", str(tmp_path / "bad.json")], "not train.py --evaluate's JSON rows"),
                       (["--tokens", "0"], "--tokens 0")):
        with pytest.raises(SystemExit) as e:
            views.main(["--ckpt", str(out), "--out", str(tmp_path / "fig3")] + argv)
        err = capsys.readouterr().err.splitlines()
        assert e.value.code == 2 and len(err) == 1 and said in err[0], err
    assert not (tmp_path / "fig3").exists()
    (out / "train_log.json").unlink()
    with pytest.raises(SystemExit) as e:
        views.main(["--ckpt", str(out), "--out", str(tmp_path / "fig2")])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"views: {out / 'train_log.json'} is missing (a folder train.py wrote has it)"]
    assert not (tmp_path / "fig2").exists()                              # nothing made before the check


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_status_2(tmp_path):
    # as the README says of every script: bad input is exit status 2 (it was 1), one line, nothing made
    from helpers import run_without
    (tmp_path / "notes.txt").write_text("mine")
    for args, said in ((["--ckpt", "nosuch", "--out", "fig"], "views: nosuch/config.json is missing (a folder "
                                                                "train.py wrote has it)"),
                       (["--ckpt", ROOT / "small-v32", "--out", "notes.txt"], "views: notes.txt exists and is not a folder")):
        r = run_without(tmp_path, (), "views.py", *args)
        assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [said], ""), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["torch", "matplotlib", "tokenizers", "ml_dtypes"])
def test_without_a_package_help_works_and_the_rest_says_what_to_install(tmp_path, missing):
    from helpers import missing_line, run_without
    r = run_without(tmp_path, [missing], "views.py", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: views.py") and r.stderr == ""
    r = run_without(tmp_path, [missing], "views.py", "--ckpt", ROOT / "small-v32", "--out", "fig")
    assert (r.returncode, r.stderr.splitlines()) == (2, [missing_line("views: ", missing, "./setup.sh --views",
                                                                      "views.py")])
    assert not (tmp_path / "fig").exists()


@pytest.mark.slow
def test_ctrl_c_is_one_line_naming_the_views_drawn(tmp_path):
    # Ctrl-C while view 3 evaluates (minutes): exit 130, one line saying which PNGs are this run's (each whole)
    # and which are not (one left from an earlier run, untouched); no temporary file left
    import sys
    from helpers import interrupt
    fig = tmp_path / "fig"
    fig.mkdir()
    (fig / "context.png").write_bytes(b"an earlier run's")
    code, err = interrupt([sys.executable, str(ROOT / "views.py"), "--ckpt", str(ROOT / "small-v32"), "--out", "fig",
                           "--tokens", "40"], "views: evaluating", cwd=tmp_path)
    assert (code, err[-1:]) == (130, ["interrupted (in fig: attention.png, recall.png drawn; context.png, "
                                      "training.png not drawn; the context.png there from an earlier run)"]), err
    assert "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in fig.iterdir()) == ["attention.png", "context.png", "recall.png"]
    assert (fig / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (fig / "context.png").read_bytes() == b"an earlier run's"
