"""train.py: the indexer's objectives in torch against the NumPy references (float64), the training forward
against model.Transformer, the stages, the evaluation's measures, a toy run of the whole recipe, and the shipped
model (small-v32/) against its recipe and bzip2; the data split, the retrieval sequences and the tokenizer."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import chat
import indexer
from conftest import ROOT
from helpers import bad_devices, without

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


@pytest.mark.slow
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


def test_the_training_forward_is_the_models_exact_forward(tmp_path):
    # the same weights (bf16 values, exported unquantized) through TrainModel and model.Transformer in
    # exact numerics: the logits agree, dense and sparse (the indexer picking 8 of up to 20 keys)
    import checkpoint
    import quant
    from model import Transformer
    cfg = checkpoint.tiny_config(vocab_size=512, num_hidden_layers=2, index_topk=8, max_position_embeddings=64)
    m = train.TrainModel(cfg, seed=3)
    with torch.no_grad():
        for prm in m.p.values():                                         # bf16 values: exported exactly
            prm.copy_(torch.from_numpy(quant.bf16_round(prm.numpy())))
    m.export(tmp_path / "c", cfg, fp8=False)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 20))
    for sparse in (False, True):
        ref_s = Transformer.from_pretrained(tmp_path / "c", numerics="exact", attention="sparse" if sparse else "dense")
        want = ref_s.forward(tokens, all_positions=True)
        got = m(torch.from_numpy(tokens), sparse=sparse).detach().numpy()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), sparse


@pytest.mark.slow
def test_the_warm_up_converges_on_a_toy():
    # eq. (3) alone, the main model frozen: the indexer learns the attention it imitates (KL falls, the
    # share of the attention mass its top-k keeps rises) and nothing else moves
    import checkpoint
    cfg = checkpoint.tiny_config(vocab_size=256, num_hidden_layers=1, first_k_dense_replace=1, index_topk=4,
                                 index_n_heads=4, max_position_embeddings=64)
    m = train.TrainModel(cfg, seed=1)
    frozen = {k: v.detach().clone() for k, v in m.p.items() if "__indexer__" not in k}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2, 24), generator=g) for _ in range(4)] * 15
    logs = train.run_stage(m, batches, "warmup", lr=3e-3)
    first, last = logs[:4], logs[-4:]
    assert sum(x["kl"] for x in last) < 0.7 * sum(x["kl"] for x in first)
    assert sum(x["recall"] for x in last) > sum(x["recall"] for x in first)
    assert all(torch.equal(m.p[k], v) for k, v in frozen.items())


@pytest.mark.slow
def test_the_other_stages_step():
    # dense: the language-model loss falls on a repeated batch; sparse: the indexer's KL (eq. (4)) trains
    # the indexer alone, its inputs detached, so no gradient of it reaches the main model
    import checkpoint
    cfg = checkpoint.tiny_config(vocab_size=256, num_hidden_layers=2, index_topk=4, max_position_embeddings=64)
    m = train.TrainModel(cfg, seed=2)
    batch = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))] * 12
    logs = train.run_stage(m, batch, "dense", lr=3e-3)
    assert logs[-1]["lm"] < logs[0]["lm"]
    for prm in m.p.values():
        prm.requires_grad_(True)
        prm.grad = None
    _, seen = m(batch[0], sparse=True, record=True, detach_indexer=True)
    kl = sum(train.indexer_kl_sparse(A, I, 4) for A, I in seen)
    kl.backward()
    got = {k for k, prm in m.p.items() if prm.grad is not None and prm.grad.any()}
    assert got and all("__indexer__" in k for k in got)
    loss, log = train.step_loss(m, batch[0], "sparse")
    assert torch.isfinite(loss) and 0 < log["recall"] <= 1


@pytest.mark.slow
def test_the_recipe_end_to_end_on_a_toy(tmp_path, capsys):
    # train.py's command on a toy budget: data, tokenizer, the three stages, the export; the result
    # loads through the model's own loader and generates through generate.py
    import subprocess
    import sys
    from pathlib import Path
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False    # as the later tests need them
    out = train.main(["--out", str(tmp_path / "m"), "--steps", "2", "2", "2", "--batch", "2", "--seq", "48", "--topk", "8",
                      "--vocab", "400", "--files", "3"])
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32   # training's tf32 set back
    assert (out / "tokenizer.json").is_file() and (out / "train_log.json").is_file()
    err = capsys.readouterr().err                                    # each stage's progress bar, to its end
    assert all(f"{stage:>6} [####################] 2/2  elapsed " in err for stage in train.STAGES)
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(root / "generate.py"), "--ckpt", str(out), "--prompt", "def f(x):", "--raw",
                        "--max-new-tokens", "8", "--temperature", "0"], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    rows = train.main(["--evaluate", str(out), "--files", "2", "--samples", "1", "--windows", "2"])     # the evaluation's table
    assert [name.split(" after ")[0] for name, *_ in rows][:2] == ["bzip2 -9, bits per byte (the held-out files, whole)", "bits per byte"]
    assert all(0 <= dense and 0 <= sparse for _, dense, sparse in rows)
    said = capsys.readouterr()                                       # the table on stdout, the bar on stderr
    assert len(said.out.splitlines()) == 1 + len(rows) and "evaluating" not in said.out
    assert re.search(r"^evaluating \[#{20}\] +(\d+)/\1  elapsed \d+:\d\d  done$", said.err, re.M)


def test_evaluation_measures():
    # bits per byte: an untrained model is near log2(vocabulary) per token, worse than bzip2; bzip2's own
    # figure against the bytes it compresses; retrieval accuracy is a share
    import checkpoint
    texts = train.read_text(train.stdlib_files(held_out=True)[:2])
    tok = train.train_tokenizer(texts, 400)
    m = train.TrainModel(checkpoint.tiny_config(vocab_size=tok.get_vocab_size(), num_hidden_layers=1,
                                                max_position_embeddings=128), seed=0)
    dense = train.bits_per_byte(m, tok, train.encode_ids(tok, texts), 32, False, max_windows=4)
    sparse = train.bits_per_byte(m, tok, train.encode_ids(tok, texts), 32, True, max_windows=4)
    bz = train.bzip2_bits_per_byte(texts)
    assert 0.5 < bz < 4 and dense > bz and sparse > bz
    assert 0 <= train.retrieval_accuracy(m, tok, 100, 2, True) <= 1


@pytest.mark.slow
def test_a_checkpoint_reads_back(tmp_path):
    import checkpoint
    cfg = checkpoint.tiny_config(vocab_size=256, num_hidden_layers=2, max_position_embeddings=64)
    m = train.TrainModel(cfg, seed=4)
    back = train.TrainModel.from_checkpoint(m.export(tmp_path / "c", cfg))     # FP8: the quantised values
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = m(tokens).detach(), back(tokens).detach()
    assert float((a - b).abs().max() / a.abs().max()) < 0.1                   # FP8's rounding, not a mix-up
    assert all(torch.equal(back.p[k], train.TrainModel.from_checkpoint(tmp_path / "c").p[k]) for k in back.p)


def test_the_router_bias_balances_the_load():
    # DeepSeek-V3's auxiliary-loss-free rule: an expert overloaded by its bias loses tokens step by step
    import checkpoint
    cfg = checkpoint.tiny_config(vocab_size=256, num_hidden_layers=2, max_position_embeddings=64)
    m = train.TrainModel(cfg, seed=5)
    key = "model__layers__1__mlp__gate__e_score_correction_bias"
    with torch.no_grad():
        m.p[key].zero_()
        m.p[key][0] = 1.0                                               # expert 0 chosen by every token
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    loads = []
    for _ in range(60):
        with torch.no_grad():
            m(tokens)
        loads.append(int(m.loads[1].max()))
        m.balance(0.05)
    assert loads[0] >= 60 and loads[-1] < 40                            # of 64 tokens: nearly all on expert 0 at first


def test_bits_per_byte_of_a_uniform_model():
    # a model that predicts every token with probability 1/V costs log2(V) bits per scored token, so the
    # figure is that times the tokens scored, over the bytes those tokens spell; the scored blocks are the
    # same for every context T (consecutive blocks from position context_max on, up to per_file of them)
    import math
    texts = train.read_text(train.stdlib_files(held_out=True)[:1])
    tok = train.train_tokenizer(texts, 300)
    V = tok.get_vocab_size()
    seen = []

    def uniform(w, sparse=False):
        seen.append(w.shape[1])
        return torch.zeros(w.shape[0], w.shape[1], V)
    ids, C, n = tok.encode(texts[0]).ids, 40, 16
    blocks = list(range(C, len(ids) - n + 1, n))[:3]
    want = 3 * n * math.log2(V) / sum(len(tok.decode(ids[p:p + n]).encode()) for p in blocks)
    for T in (8, 40):
        seen.clear()
        got = train.bits_per_byte(uniform, tok, [ids], T, False, max_windows=9, scored=n, context_max=C, per_file=3)
        assert abs(got - want) <= 1e-6 * want and seen == [T + n] * 3               # fp32 cross-entropy


SHIPPED = __import__("pathlib").Path(__file__).resolve().parent.parent / "small-v32"


def test_the_shipped_model_is_train_pys_recipe():
    # python train.py --out small-v32 --device cuda retrains it: every recipe option in its log is the default
    log = json.loads((SHIPPED / "train_log.json").read_text())
    defaults = vars(train.parser().parse_args(["--out", "x"]))
    recipe = {k: v for k, v in log["args"].items() if k not in ("out", "evaluate", "device", "force")}
    assert recipe == {k: defaults[k] for k in recipe}
    later = set(defaults) - set(log["args"])                      # options added after the run, at the old behaviour
    assert later <= {"queries", "json", "windows", "force"} and defaults["queries"] == 1
    assert [len(log["log"][s]) for s in train.STAGES] == defaults["steps"]
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert cfg["index_topk"] == defaults["topk"] < defaults["seq"]


def test_the_shipped_model_beats_bzip2_and_its_warm_up_converged():
    # a few held-out blocks (never trained on: files held out by path), dense and sparse, against bzip2 -9
    # on the whole files; the log's warm-up: the KL of eq. (3) falls, the top-k's share of attention rises
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    m = train.TrainModel.from_checkpoint(SHIPPED).eval()
    held = [t for t in train.read_text(train.evaluation_files()) if len(t) > 4000][:4]   # one block from each of four
    for sparse in (False, True):
        bpb = train.bits_per_byte(m, tok, train.encode_ids(tok, held), 128, sparse, max_windows=4, per_file=1)
        assert bpb < 0.85 * train.bzip2_bits_per_byte(held)
    warm = json.loads((SHIPPED / "train_log.json").read_text())["log"]["warmup"]
    assert np.mean([e["kl"] for e in warm[-20:]]) < 0.2 * np.mean([e["kl"] for e in warm[:5]])
    assert np.mean([e["recall"] for e in warm[-20:]]) > np.mean([e["recall"] for e in warm[:5]]) + 0.2


def test_bad_input_gets_one_line_and_touches_nothing(tmp_path, capsys):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    for argv, said in ((["--out", str(theirs)], "is not empty (it holds 1 file)"),
                       (["--evaluate", str(tmp_path / "none")], "no config.json"),
                       (["--out", str(tmp_path / "n"), "--steps", "0", "1", "1"], "must be positive"),
                       (["--out", str(tmp_path / "n"), "--dropout", "1.5"], "a probability below 1"),
                       (["--out", str(tmp_path / "n"), "--device", "nonsense"], "--device nonsense"),
                       (["--evaluate", str(SHIPPED), "--files", "0"], "must be positive"),
                       (["--evaluate", str(SHIPPED), "--json", str(tmp_path / "no" / "e.json")], "does not exist")):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"] and not (tmp_path / "n").exists()


def test_bits_per_byte_scores_each_token_by_the_prediction_before_it():
    # a model that gives the true next token probability 1/2 costs exactly 1 bit per scored token; read one
    # position off (a misaligned slice of logits or targets) it would cost about log2(2 (V - 1)) bits instead
    import math
    texts = train.read_text(train.stdlib_files(held_out=True)[:1])
    tok = train.train_tokenizer(texts, 300)
    V = tok.get_vocab_size()

    def half_right(w, sparse=False):  # logits [1, L, V]: position t puts log(V - 1) on token w[t + 1]
        logits = torch.zeros(1, w.shape[1], V)
        logits[0, torch.arange(w.shape[1] - 1), w[0, 1:]] = math.log(V - 1)
        return logits
    ids, C, n = tok.encode(texts[0]).ids, 24, 16
    blocks = list(range(C, len(ids) - n + 1, n))[:4]
    want = 4 * n / sum(len(tok.decode(ids[p:p + n]).encode()) for p in blocks)
    got = train.bits_per_byte(half_right, tok, [ids], C, False, max_windows=4, scored=n, per_file=4)
    assert abs(got - want) <= 1e-5 * want


# -----------------------------------------------------------------------------
# --out writes only to a new or empty folder (--force: any), refused before any training

def test_out_refuses_a_non_empty_folder_before_training(tmp_path, monkeypatch, capsys):
    from test_checkpoint import built, trained, tree
    monkeypatch.setattr(train, "train", lambda a: pytest.fail("training started before the refusal"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for folder, held in ((trained(tmp_path / "t"), "a checkpoint train.py trained"),
                         (built(tmp_path / "b"), "a checkpoint checkpoint.py built"), (mine, "1 file")):
        before = tree(folder)
        with pytest.raises(SystemExit) as e:
            train.main(["--out", str(folder)])
        assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
            f"train.py: error: {folder} is not empty (it holds {held}); train.py writes only to a new or empty "
            "folder (--force replaces it anyway)"]
        assert tree(folder) == before
    monkeypatch.setattr(train, "train", lambda a: ("trained", a.force))            # --force: on to training
    assert train.main(["--out", str(tmp_path / "t"), "--force"]) == ("trained", True)


def test_export_replaces_a_checkpoint_only_with_force(tmp_path):
    from test_checkpoint import trained, tree
    out = trained(tmp_path / "t")
    before = tree(out)
    cfg = json.loads((out / "config.json").read_text())
    m = train.TrainModel(cfg, seed=1)
    with pytest.raises(FileExistsError, match="holds a checkpoint train.py trained"):
        m.export(out, cfg)
    assert tree(out) == before
    m.export(out, cfg, force=True)                                              # replaced whole: no tokenizer.json
    assert sorted(tree(out)) == sorted(set(before) - {"tokenizer.json"}) and tree(out) != before
    assert (out / ".dsa-ref-checkpoint").read_text().startswith("trained by train.py")
    assert [p.name for p in tmp_path.iterdir()] == ["t"]                        # nothing moved aside left


@pytest.mark.slow
def test_out_cli_keeps_the_shipped_model(tmp_path):
    # `python train.py --out small-v32` in one line, exit 2, before the data is even read (the recipe's
    # defaults would train for hours: the timeout would fail this); every byte of the folder kept
    from test_checkpoint import shipped_copy, tree
    out = shipped_copy(tmp_path)
    before = tree(out)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--out", "small-v32"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [
        "train.py: error: small-v32 is not empty (it holds a checkpoint train.py trained); train.py writes only to "
        "a new or empty folder (--force replaces it anyway)"], "")
    assert tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["small-v32"]


def test_without_torch_help_works_and_the_rest_says_what_to_install(tmp_path):
    env = without(tmp_path, "torch")
    run = lambda *args: subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: train.py") and r.stderr == ""
    for args in (["--out", "new"], ["--evaluate", str(ROOT / "small-v32")]):
        r = run(*args)
        assert (r.returncode, r.stderr.splitlines()) == (2, [
            "train.py: error: torch is not installed in this Python: run ./setup.sh --torch (its CPU build; "
            "./setup.sh --tests installs everything)"]), args
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("device, said", bad_devices())
def test_device_is_one_line_before_any_work(tmp_path, device, said):
    # --device cuda without CUDA was an AssertionError traceback (Torch not compiled with CUDA enabled)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--out", "new", "--device", device], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("train.py: error: " + said) and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["ml_dtypes", "tokenizers"])
def test_a_python_without_the_packages_names_the_setup(tmp_path, missing):
    from helpers import missing_line, run_without
    for args in (["--out", "new"], ["--evaluate", ROOT / "small-v32"]):
        r = run_without(tmp_path, [missing], "train.py", *args)
        assert (r.returncode, r.stderr.splitlines()) == (2, [missing_line("train.py: error: ", missing,
                                                                          "./setup.sh --torch", "train.py")]), args
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_leaves_nothing_half_written(tmp_path):
    # --evaluate (minutes) and training: exit 130, one line saying what is there, no --json, no checkpoint
    from helpers import interrupt
    code, err = interrupt([sys.executable, str(ROOT / "train.py"), "--evaluate", str(ROOT / "small-v32"), "--json",
                           "e.json"], str(ROOT / "small-v32") + ": index_topk", stream="stdout", cwd=tmp_path)
    assert (code, err[-1:]) == (130, ["interrupted (the rows so far are printed above; --json e.json is written only "
                                      "once all are done)"]), err
    code, err = interrupt([sys.executable, str(ROOT / "train.py"), "--out", "new", "--steps", "100000", "1", "1",
                           "--batch", "2", "--seq", "48", "--topk", "8", "--vocab", "400", "--files", "3"], "data: ",
                          cwd=tmp_path)
    assert (code, err[-1:]) == (130, ["interrupted (no half-written checkpoint in new: it is written whole, at the "
                                      "end)"]), err
    assert list(tmp_path.iterdir()) == [] and not any("Traceback" in line for line in err)


def test_progress_bar_in_a_log(monkeypatch):
    # not a terminal: a line at most every `every` seconds and the last one once; the time left is the time
    # so far per unit of work times the work left
    import io
    import progress
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    log = io.StringIO()
    bar = progress.Progress(8, "stage", total_work=100, stream=log, every=5)
    for done, work, t in ((1, 25, 10), (2, 50, 12), (3, 60, 16), (8, 100, 40)):
        now[0] = t
        bar.update(done, note="lm 2.5", work=work)
    bar.close()
    assert log.getvalue().splitlines() == [
        "stage [#####...............] 1/8  elapsed 0:10  left ~0:30  lm 2.5",     # 25 of 100 in 10 s: 30 s more
        "stage [############........] 3/8  elapsed 0:16  left ~0:11  lm 2.5",     # (12 s: too soon for a line)
        "stage [####################] 8/8  elapsed 0:40  done  lm 2.5"]            # 40 left of 60 in 16 s: 10.7 s


def test_progress_bar_on_a_terminal(monkeypatch):
    # a terminal: redrawn in place (carriage return, line cleared), wiped for other output, ended by a newline
    import io
    import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = Terminal()
    bar = progress.Progress(2, "x", stream=out)
    now[0] = 5
    bar.update(1)
    bar.clear()
    now[0] = 3725
    bar.close()
    assert out.getvalue() == ("\r\033[Kx [##########..........] 1/2  elapsed 0:05  left ~0:05"
                              "\r\033[K"
                              "\r\033[Kx [####################] 2/2  elapsed 1:02:05  done\n")
