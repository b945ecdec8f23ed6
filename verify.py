"""`generate.py --verify`: does this backend on this device compute the model?

Three comparisons, each printed with what it compares against what:

1. Across backends, in exact numerics: a fixed token sequence through the chosen backend and through
   the NumPy reference (only the first N layers with --verify-layers N, for checkpoints too large
   for the CPU); per layer the relative error of the hidden states and the overlap of the indexer's
   top-k selections; the hash of a 16-token greedy continuation from each. Not run for
   backend="numpy": it would compare the reference with itself.
2. Fixed tokens, on any platform: the checkpoint in exact numerics, teacher-forced with the greedy
   continuation the NumPy reference recorded; at each of its 16 positions the recorded greedy token
   must still be the top one (or within the tolerance of it: a near tie may flip) and the recorded
   top-4 logits must keep their values within FIXED_TOLERANCE. Exact numerics because they hold across
   platforms: float32 throughout, while the official numerics' bf16 / FP8 rounding points and the
   indexer's top-k turn a last-bit difference into another selection (a 1e-5 change of one norm's
   weights moves tiny-v32's official logits by 30%, its exact ones by 2.5e-5).
3. Bits, where the bits are the same: greedy tokens and a hash of the logits rounded to bf16, in the
   chosen numerics, compared with the golden of the same checkpoint, backend, numerics and layers
   recorded under the same bits key (platform_id). The key names what decides a float32 result's bits:
   NumPy's version and the SIMD target its loops dispatch to, the BLAS library, its version and the
   kernels it picked for this CPU (OpenBLAS's core type), ml_dtypes' version; for torch its version,
   and on the CPU its SIMD level, the CPU vendor (MKL's dispatch) and its threads, on a GPU the GPU and
   Triton. Not the CPU's name, family or core count: OpenBLAS's threads split a product's rows, not
   its sums (1, 2 and 4 threads give the same bits), and two CPUs whose OpenBLAS picks the same kernels
   give the same bits (OPENBLAS_CORETYPE=Haswell and =SandyBridge each move them on an EPYC that
   picks SkylakeX). A golden under another key is listed, not compared.

goldens.json holds, per checkpoint fingerprint, its name, the fixed-token records ("fixed", by
numerics and layers) and the bit-level goldens ("bits", by bits key, then backend/numerics/layers).
A file of the earlier form ({fingerprint: {platform line: {key: golden}}}) still reads: its lines
become bits keys that no platform of today's form matches. --record-golden FILE writes this run's
golden (and, from the NumPy backend, its fixed-token record) into FILE, in the same form, created or
updated whole or not at all; the tracked goldens.json is only read.

The verdict: PASS when at least one comparison ran and every one held (exit 0), FAIL when one did
not (exit 1), NOTHING COMPARED when none could run (exit 3: the NumPy backend on a checkpoint with
no record), so a PASS always means something was checked.
"""
import ctypes
import glob
import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

import quant
from model import Transformer

GOLDENS = Path(__file__).with_name("goldens.json")
TOLERANCE = {"hidden": 1e-4, "overlap": 0.99}        # exact numerics, backend vs NumPy reference
# Fixed tokens: |logit - recorded| / (the largest recorded top logit), at the recorded top-4 of each
# position. Float32 rounding measured between platforms on the bundled checkpoints (NumPy on OpenBLAS's
# SkylakeX, Haswell and SandyBridge kernels, NumPy's AVX512 and AVX2 loops, torch on the CPU): at most
# 1.2e-6 on these values, 2.9e-6 over whole logit rows (the H200 against NumPy: 2.3e-6). 1e-5 leaves
# 3x to 8x of that; a wrong computation moves them more (one norm's weights off by 1e-5: 2.5e-5).
FIXED_TOLERANCE = 1e-5
N_TOKENS, N_CONTINUE, TOP_K = 48, 16, 4
PASS, FAIL, NOTHING = 0, 1, 3                         # verdicts, as exit codes


def fingerprint(ckpt):  # the checkpoint's identity: config, index and each shard's header + first bytes
    h = hashlib.sha256()
    ckpt = Path(ckpt)
    for name in ("config.json", "model.safetensors.index.json"):
        if (ckpt / name).is_file():
            h.update((ckpt / name).read_bytes())
    for shard in sorted(ckpt.glob("*.safetensors")):
        with open(shard, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def simd_target():  # the SIMD target NumPy's loops dispatch to here: "AVX512_ICL"
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:                                                  # NumPy's internals moved
        return "SIMD unknown"
    best = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    return best[-1] if best else "baseline"


def openblas_core(lib_dir):  # the kernels OpenBLAS's DYNAMIC_ARCH picked for this CPU, or None
    names = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "*openblas*"))
    names += glob.glob(os.path.join(lib_dir or "", "*openblas*.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)                                      # loaded already: the same handle
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"):
            if hasattr(lib, symbol):
                getattr(lib, symbol).restype = ctypes.c_char_p
                return getattr(lib, symbol)().decode()
    return None


def blas():  # "OpenBLAS 0.3.31.188.0 SkylakeX": the library that sums NumPy's products, and its kernels
    try:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:                                                    # an older NumPy, another layout
        return "BLAS unknown"
    name = info.get("name", "BLAS")
    core = openblas_core(info.get("lib directory")) if "openblas" in name.lower() else None
    core = core or os.environ.get("OPENBLAS_CORETYPE") or "cores unknown"
    return f"{name} {info.get('version', '?')} {core}"


def cpu_vendor():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def platform_id(backend, device):  # the bits key: what decides a float32 result's bits, as one line
    import ml_dtypes
    parts = [f"numpy {np.__version__} {simd_target()}", blas(), f"ml_dtypes {ml_dtypes.__version__}"]
    if backend == "torch":                                               # RoPE's angles stay NumPy's
        import torch
        if device in (None, "cpu"):
            parts.append(f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} on {cpu_vendor()}")
            parts.append(f"torch threads {torch.get_num_threads()}")        # a product's sum order follows them
        else:
            import triton
            parts += [torch.cuda.get_device_name(torch.device(device)), f"torch {torch.__version__}",
                      f"triton {triton.__version__}"]
    return ", ".join(parts)


def to_numpy(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def run(m, tokens, forced=None):
    """-> (per-layer hidden [L] of [T, d], per-layer selections, prefill logits [T, V], greedy continuation,
    the logits [N_CONTINUE, V] each continuation token is picked from). forced: tokens to feed instead of
    the greedy ones (teacher forcing), so that a near tie that flips does not move the later positions."""
    rec = {}
    logits = to_numpy(m.forward(tokens[None], all_positions=True, record=rec))[0]
    rows, pos = [logits[-1]], len(tokens)
    for i in range(N_CONTINUE - 1):
        nxt = forced[i] if forced else int(rows[-1].argmax())
        rows.append(to_numpy(m.forward([[nxt]], start_pos=pos))[0])
        pos += 1
    rows = np.stack(rows)
    hidden = [to_numpy(h)[0] for h in rec.get("hidden", [])]
    selected = [None if s is None else to_numpy(s)[0].astype(bool)      # None: a layer without an indexer
                for s in rec.get("selected", [])]
    return hidden, selected, logits, [int(t) for t in rows.argmax(-1)], rows


def digest(values):
    return hashlib.sha256(np.asarray(values).tobytes()).hexdigest()[:16]


def layer_count(cfg, ckpt, layers):  # --verify-layers N -> N, or None for the whole model; checked against the config
    L = cfg.get("num_hidden_layers")
    if layers is None or not isinstance(L, int):
        return None
    if not 1 <= layers <= L:
        raise ValueError(f"--verify-layers {layers}: {ckpt} has {L} layers, so N must be 1..{L}")
    return None if layers == L else layers


def compare_backends(ckpt, backend, device, layers, tokens, out):  # comparison 1 -> True when it holds
    ref = Transformer.from_pretrained(ckpt, numerics="exact", n_layers=layers)
    sub = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics="exact", n_layers=layers)
    hr, sr, lr, cr, _ = run(ref, tokens)
    hs, ss, ls, cs, _ = run(sub, tokens)
    print(f"1. {backend} on {device or 'cpu'} against the NumPy reference, exact numerics, {len(hr)} layers, "
          f"{len(tokens)} tokens", file=out)
    print("layer | rel. error of hidden states | indexer top-k overlap", file=out)
    ok = True
    for i, (a, b) in enumerate(zip(hs, hr)):
        err = float(np.abs(a - b).max() / np.abs(b).max())
        picks = i < len(sr) and i < len(ss) and sr[i] is not None                     # V4: CSA layers only
        ov = float((ss[i] & sr[i]).sum() / max(sr[i].sum(), 1)) if picks else None
        good = err <= TOLERANCE["hidden"] and (ov is None or ov >= TOLERANCE["overlap"])
        ok &= good
        shown = f"{ov:21.4f}" if picks else f"{'-':>21}"
        print(f"{i:5d} | {err:27.2e} | {shown}{'' if good else '   <-- beyond tolerance'}", file=out)
    lerr = float(np.abs(ls - lr).max() / np.abs(lr).max())
    same = cs == cr
    ok &= lerr <= TOLERANCE["hidden"] and same
    print(f"logits rel. error {lerr:.2e} (tolerance {TOLERANCE['hidden']:.0e}); greedy continuation {digest(cs)} "
          f"vs reference {digest(cr)}{'' if same else '  <-- differs'}", file=out)
    return ok


def load_goldens(path):  # -> {fingerprint: {"name": ..., "fixed": {...}, "bits": {bits key: {combination: golden}}}}
    if path is None or not Path(path).is_file():
        return {}
    data = json.loads(Path(path).read_text())
    if data.get("format") == 2:
        return data["checkpoints"]
    return {fp: {"bits": lines} for fp, lines in data.items()}        # the earlier form: platform lines as keys


def save_goldens(path, goldens):  # the whole file or nothing: a reader never sees half of it
    from checkpoint import write_whole
    write_whole(path, lambda tmp: tmp.write_text(json.dumps({"format": 2, "checkpoints": goldens}, indent=1,
                                                            sort_keys=True) + "\n"))


def fixed_record(greedy, rows):  # what the fixed-token check keeps of a free greedy run
    top = np.argsort(-rows, -1, kind="stable")[:, :TOP_K]
    return {"greedy": greedy, "top_ids": top.tolist(), "top_logits": np.take_along_axis(rows, top, -1).tolist(),
            "recorded_on": platform_id("numpy", None)}


def check_fixed(rec, rows, out):  # comparison 2 on teacher-forced rows -> True when it holds
    ids, want = np.array(rec["top_ids"]), np.array(rec["top_logits"], np.float64)
    scale = np.abs(want[:, 0]).max()
    err = float(np.abs(np.take_along_axis(rows, ids, -1) - want).max() / scale)
    greedy = np.array(rec["greedy"])
    behind = rows.max(-1) - rows[np.arange(len(greedy)), greedy]       # 0 where it is still the top one
    held, top = int((behind <= FIXED_TOLERANCE * scale).sum()), int((behind == 0).sum())
    ok = held == len(greedy) and err <= FIXED_TOLERANCE
    ties = f", {held - top} within the tolerance of it" if held > top else ""
    print(f"   {held}/{len(greedy)} recorded greedy tokens hold ({top} the top one{ties}); top-{TOP_K} logits "
          f"max rel. error {err:.2e} (tolerance {FIXED_TOLERANCE:.0e})"
          f"{'' if ok else '  <-- beyond tolerance'}", file=out)
    return ok


def check_bits(golden, result, out):  # comparison 3 -> True when it holds
    greedy, same = golden["greedy"] == result["greedy"], golden["logits_bf16"] == result["logits_bf16"]
    print(f"   greedy tokens {'match' if greedy else 'DIFFER'}, logits hash "
          f"{'matches' if same else 'DIFFERS'} ({result['logits_bf16']} vs {golden['logits_bf16']})", file=out)
    return greedy and same


def fixed_tokens(ckpt, backend, device, layers, tokens, rec, exact_run, out):  # comparison 2 -> True, False or None
    where = f"exact/{layers or 'all'}"
    if rec is None:
        print(f"2. fixed tokens, exact numerics: no {where} record for this checkpoint (not compared)", file=out)
        return None
    print(f"2. fixed tokens, exact numerics, teacher-forced: {backend} on {device or 'cpu'} against the {where} "
          f"record of the NumPy reference on {rec['recorded_on']}", file=out)
    rows = exact_run[4]
    if exact_run[3] != rec["greedy"]:                                   # a near tie flipped: feed the recorded ones
        m = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics="exact", n_layers=layers)
        rows = run(m, tokens, forced=rec["greedy"])[4]
    return check_fixed(rec, rows, out)


def bits(combo, here, result, recorded, out):  # comparison 3 -> True, False or None
    golden = recorded.get(here, {}).get(combo)
    if golden is not None:
        print(f"3. bits of {combo} against its golden recorded under this bits key", file=out)
        return check_bits(golden, result, out)
    elsewhere = [key for key, combos in recorded.items() if combo in combos]
    print(f"3. bits of {combo}: no golden under this bits key (not compared); recorded under "
          f"{len(elsewhere)} other{'' if len(elsewhere) == 1 else 's'}{':' if elsewhere else ''}", file=out)
    for key in elsewhere:
        print(f"   {key}", file=out)
    return None


def write_record(path, fp, name, here, combo, result, fixed, out):  # --record-golden FILE
    goldens = load_goldens(path)
    entry = goldens.setdefault(fp, {})
    entry["name"] = name
    entry.setdefault("bits", {}).setdefault(here, {})[combo] = result
    if fixed:
        entry.setdefault("fixed", {}).update(fixed)
    save_goldens(path, goldens)
    print(f"   recorded in {path}: bits of {combo} under this key (greedy {digest(result['greedy'])}, logits hash "
          f"{result['logits_bf16']}){', the fixed-token record ' + next(iter(fixed)) if fixed else ''}", file=out)


def check_record(path):  # --record-golden FILE: never the tracked goldens.json (ValueError, before any work)
    p = Path(path)
    if p.resolve() == GOLDENS.resolve() or (p.exists() and GOLDENS.exists() and p.samefile(GOLDENS)):
        raise ValueError(f"--record-golden {path}: that is the tracked {GOLDENS.name}, which --verify only reads; "
                         "record into another file (a maintainer merges it)")


def verify(ckpt, backend="torch", device=None, numerics="official", layers=None, record=None, out=sys.stdout,
           goldens_path=GOLDENS):
    """Print the comparisons and a verdict; -> PASS (0), FAIL (1) or NOTHING compared (3).
    record: the path of a goldens file to write this run's golden into (never the tracked goldens.json:
    a ValueError), or None; goldens_path is only read."""
    from checkpoint import Checkpoint
    if record is True:                                                   # the earlier flag: say where to write
        raise TypeError("verify(record=...) takes the path of the file to write, or None")
    if record:
        check_record(record)
    cfg = Checkpoint(ckpt).config
    layers = layer_count(cfg, ckpt, layers)
    tokens = np.random.default_rng(20261130).integers(3, min(cfg.get("vocab_size", 4), 100000), N_TOKENS)
    fp, here = fingerprint(ckpt), platform_id(backend, device)
    recorded = load_goldens(goldens_path).get(fp, {})
    print(f"verify {ckpt} ({fp}{', recorded as ' + recorded['name'] if 'name' in recorded else ''}): backend "
          f"{backend}, device {device or 'cpu'}, {numerics} numerics, "
          f"{'all layers' if layers is None else f'first {layers} layers'}; goldens from {goldens_path}", file=out)
    print(f"bits key here: {here}", file=out)
    results = []                                                         # one bool per comparison that ran
    if backend == "numpy":
        print("1. against the NumPy reference: not run (the numpy backend IS the reference)", file=out)
    else:
        results.append(compare_backends(ckpt, backend, device, layers, tokens, out))

    def model_run(n):
        m = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics=n, n_layers=layers)
        return run(m, tokens)
    chosen = model_run(numerics)
    exact = chosen if numerics == "exact" else model_run("exact")
    fixed_key = f"exact/{layers or 'all'}"
    results.append(fixed_tokens(ckpt, backend, device, layers, tokens, recorded.get("fixed", {}).get(fixed_key),
                                exact, out))
    combo = f"{backend}/{numerics}/{layers or 'all'}"
    result = {"greedy": chosen[3], "logits_bf16": digest(quant.bf16_round(chosen[2]).astype(np.float32))}
    results.append(bits(combo, here, result, recorded.get("bits", {}), out))
    if record:
        fixed = {fixed_key: fixed_record(exact[3], exact[4])} if backend == "numpy" else {}   # the reference's
        write_record(record, fp, Path(ckpt).name, here, combo, result, fixed, out)
    results = [r for r in results if r is not None]
    if not results:
        print("VERIFY NOTHING COMPARED: nothing recorded for this checkpoint applies here (exit 3); "
              "--record-golden FILE records this run", file=out)
        return NOTHING
    print(f"VERIFY {'PASS' if all(results) else 'FAIL'} ({len(results)} comparison{'s' if len(results) > 1 else ''})",
          file=out)
    return PASS if all(results) else FAIL
