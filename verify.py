"""`generate.py --verify`: does this backend on this device compute the model?

Two comparisons, each printed with what it compares against what:

1. Across backends, in exact numerics: a fixed token sequence through the chosen backend and through
   the NumPy reference (only the first N layers with --verify-layers N, for checkpoints too large
   for the CPU); per layer the relative error of the hidden states and the overlap of the indexer's
   top-k selections; the hash of a 16-token greedy continuation from each. Not run for
   backend="numpy": it would compare the reference with itself.
2. Against recorded goldens, in the chosen numerics: greedy tokens and a hash of the logits rounded
   to bf16, compared only with the golden of the same checkpoint, backend, numerics and layers,
   recorded on the same platform (goldens.json; --record-golden writes the current one). Float32
   results are bit-level facts of a platform: the CPU model and core count (NumPy's SIMD loops and
   BLAS kernels follow the CPU; reductions may follow the threads), the GPU, and the versions of the
   libraries that compute. Another platform gets "no golden recorded for this platform", never a FAIL.

The verdict: PASS when at least one comparison ran and every one held (exit 0), FAIL when one did
not (exit 1), NOTHING COMPARED when none could run (exit 3: the NumPy backend on a platform with no
golden), so a PASS always means something was checked.

A run of the DSA kernel path on the H200 (2026-12-01):

    $ .venv/bin/python generate.py --ckpt tiny-v32 --verify --backend torch --device cuda     # H200, 2026-12-01
    verify tiny-v32 (dbfbc62aac468e20): backend torch, device cuda, official numerics, all layers
    1. torch on cuda against the NumPy reference, exact numerics, 4 layers, 48 tokens
    layer | rel. error of hidden states | indexer top-k overlap
        0 |                    6.73e-07 |                1.0000
        1 |                    1.12e-06 |                1.0000
        2 |                    1.45e-06 |                1.0000
        3 |                    2.17e-06 |                1.0000
    logits rel. error 2.28e-06 (tolerance 1e-04); greedy continuation 15e5bced9a407fae vs reference 15e5bced9a407fae
    2. against the golden torch/official/all of checkpoint dbfbc62aac468e20 recorded on this platform: NVIDIA H200, numpy 2.5.2, ml_dtypes 0.7.0, torch 2.11.0+cu130, triton 3.6.0
       greedy tokens match, logits hash matches (00976c24fada28c4 vs 00976c24fada28c4)
    VERIFY PASS (2 comparisons)
"""
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
N_TOKENS, N_CONTINUE = 48, 16
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


def cpu_name():  # "AMD EPYC (family 25, model 17), AVX512_ICL": the model and NumPy's SIMD loops on it
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    name = info.get("model name", platform.processor() or platform.machine())
    if "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
        best = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
        name += f", {best[-1] if best else 'baseline'}"
    except ImportError:                                                  # NumPy's internals moved
        pass
    return name


def platform_id(backend, device):  # what decides a float32 result's bits, as one readable line
    import ml_dtypes
    parts = [f"{cpu_name()}, {os.cpu_count()} cores", f"numpy {np.__version__}", f"ml_dtypes {ml_dtypes.__version__}"]
    if os.environ.get("OPENBLAS_CORETYPE"):
        parts.append(f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}")
    if backend == "torch":
        import torch
        parts.append(f"torch {torch.__version__}")
        if device in (None, "cpu"):
            parts.append(f"torch threads {torch.get_num_threads()}")        # a product's sum order follows them
        else:
            import triton
            parts[0] = torch.cuda.get_device_name(torch.device(device))   # the GPU computes
            parts.append(f"triton {triton.__version__}")
    return ", ".join(parts)


def to_numpy(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def run(m, tokens):
    """-> (per-layer hidden [L] of [T, d], per-layer selections, prefill logits [T, V], greedy continuation)."""
    rec = {}
    logits = to_numpy(m.forward(tokens[None], all_positions=True, record=rec))[0]
    cont, nxt, pos = [], int(logits[-1].argmax()), len(tokens)
    for _ in range(N_CONTINUE):
        cont.append(nxt)
        nxt = int(to_numpy(m.forward([[nxt]], start_pos=pos))[0].argmax())
        pos += 1
    hidden = [to_numpy(h)[0] for h in rec.get("hidden", [])]
    selected = [None if s is None else to_numpy(s)[0].astype(bool) for s in rec.get("selected", [])]   # None: no indexer
    return hidden, selected, logits, cont


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
    hr, sr, lr, cr = run(ref, tokens)
    hs, ss, ls, cs = run(sub, tokens)
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


def verify(ckpt, backend="torch", device=None, numerics="official", layers=None, record=False, out=sys.stdout,
           goldens_path=GOLDENS):
    """Print the comparisons and a verdict; -> PASS (0), FAIL (1) or NOTHING compared (3)."""
    from checkpoint import Checkpoint
    cfg = Checkpoint(ckpt).config
    layers = layer_count(cfg, ckpt, layers)
    tokens = np.random.default_rng(20261130).integers(3, min(cfg.get("vocab_size", 4), 100000), N_TOKENS)
    results = []                                                         # one bool per comparison that ran
    print(f"verify {ckpt} ({fingerprint(ckpt)}): backend {backend}, device {device or 'cpu'}, "
          f"{numerics} numerics, {'all layers' if layers is None else f'first {layers} layers'}", file=out)
    if backend == "numpy":
        print("1. against the NumPy reference: not run (the numpy backend IS the reference)", file=out)
    else:
        results.append(compare_backends(ckpt, backend, device, layers, tokens, out))

    # 2. the golden of this checkpoint, backend, numerics and layers, on this platform
    m = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics=numerics, n_layers=layers)
    _, _, logits, cont = run(m, tokens)
    result = {"greedy": cont, "logits_bf16": digest(quant.bf16_round(logits).astype(np.float32))}
    fp, where = fingerprint(ckpt), platform_id(backend, device)
    key = f"{backend}/{numerics}/{layers or 'all'}"
    goldens = json.loads(goldens_path.read_text()) if goldens_path.is_file() else {}
    print(f"2. against the golden {key} of checkpoint {fp} recorded on this platform: {where}", file=out)
    if record:
        goldens.setdefault(fp, {}).setdefault(where, {})[key] = result
        tmp = goldens_path.with_suffix(".tmp")                           # whole file or nothing
        tmp.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, goldens_path)
        print(f"   recorded in {goldens_path} (greedy {digest(cont)}, logits hash {result['logits_bf16']})", file=out)
    elif key in goldens.get(fp, {}).get(where, {}):
        g = goldens[fp][where][key]
        greedy, logits_same = g["greedy"] == cont, g["logits_bf16"] == result["logits_bf16"]
        results.append(greedy and logits_same)
        print(f"   greedy tokens {'match' if greedy else 'DIFFER'}, logits hash "
              f"{'matches' if logits_same else 'DIFFERS'} ({result['logits_bf16']} vs {g['logits_bf16']})", file=out)
    else:
        print(f"   no golden recorded for this platform (--record-golden records one; {sum(len(v) for v in goldens.get(fp, {}).values())} "
              f"recorded for this checkpoint elsewhere)", file=out)
    if not results:
        print("VERIFY NOTHING COMPARED: no reference to compare with here (exit 3); with --backend torch the "
              "NumPy reference is compared", file=out)
        return NOTHING
    print(f"VERIFY {'PASS' if all(results) else 'FAIL'} ({len(results)} comparison{'s' if len(results) > 1 else ''})",
          file=out)
    return PASS if all(results) else FAIL
