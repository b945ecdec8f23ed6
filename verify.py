"""`generate.py --verify`: does this backend on this device compute the model?

1. Across backends, in exact numerics: a fixed token sequence through the chosen backend and through
   the NumPy reference (only the first N layers with --verify-layers N, for checkpoints too large
   for the CPU); per layer the relative error of the hidden states and the overlap of the indexer's
   top-k selections; the hash of a 16-token greedy continuation from each.
2. Against recorded goldens, in the chosen numerics: greedy tokens and a hash of the logits rounded
   to bf16, compared only with the golden of the same checkpoint, backend, device and numerics
   (goldens.json; --record-golden writes the current one). Official numerics are bit-level: other
   hardware or BLAS may round differently, which is why goldens are never compared across kinds.

Then a verdict: exit code 0 when everything holds.
"""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from model import Transformer

GOLDENS = Path(__file__).with_name("goldens.json")
TOLERANCE = {"hidden": 1e-4, "overlap": 0.99}        # exact numerics, backend vs NumPy reference
N_TOKENS, N_CONTINUE = 48, 16


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
    selected = [to_numpy(s)[0].astype(bool) for s in rec.get("selected", [])]
    return hidden, selected, logits, cont


def digest(values):
    return hashlib.sha256(np.asarray(values).tobytes()).hexdigest()[:16]


def verify(ckpt, backend="torch", device=None, numerics="official", layers=None, record=False, out=sys.stdout):
    """Print the checks and a verdict; -> True when everything holds."""
    ok = True
    ref = Transformer.from_pretrained(ckpt, numerics="exact", n_layers=layers)
    sub = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics="exact", n_layers=layers)
    rng = np.random.default_rng(20261130)
    tokens = rng.integers(3, min(ref.args.vocab_size, 100000), N_TOKENS)
    hr, sr, lr, cr = run(ref, tokens)
    hs, ss, ls, cs = run(sub, tokens)
    print(f"verify {ckpt}: {backend} on {device or 'cpu'} against the NumPy reference, exact numerics, "
          f"{len(hr)} layers, {N_TOKENS} tokens", file=out)
    print("layer | rel. error of hidden states | indexer top-k overlap", file=out)
    for i, (a, b) in enumerate(zip(hs, hr)):
        err = float(np.abs(a - b).max() / np.abs(b).max())
        ov = (float((ss[i] & sr[i]).sum() / sr[i].sum()) if i < len(sr) and i < len(ss) else 1.0)
        good = err <= TOLERANCE["hidden"] and ov >= TOLERANCE["overlap"]
        ok &= good
        print(f"{i:5d} | {err:27.2e} | {ov:21.4f}{'' if good else '   <-- beyond tolerance'}", file=out)
    lerr = float(np.abs(ls - lr).max() / np.abs(lr).max())
    same = cs == cr
    ok &= lerr <= TOLERANCE["hidden"] and same
    print(f"logits rel. error {lerr:.2e}; greedy continuation {digest(cs)} vs reference {digest(cr)}"
          f"{'' if same else '  <-- differs'}", file=out)

    # goldens of this exact combination, in the chosen numerics
    m = Transformer.from_pretrained(ckpt, backend=backend, device=device, numerics=numerics, n_layers=layers)
    _, _, logits, cont = run(m, tokens)
    import quant
    result = {"greedy": cont, "logits_bf16": digest(quant.bf16_round(logits).astype(np.float32))}
    key = f"{backend}/{device_name(device)}/{numerics}/{layers or 'all'}"
    fp = fingerprint(ckpt)
    goldens = json.loads(GOLDENS.read_text()) if GOLDENS.is_file() else {}
    if record:
        goldens.setdefault(fp, {})[key] = result
        GOLDENS.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")
        print(f"golden recorded for {fp} {key}", file=out)
    elif key in goldens.get(fp, {}):
        g = goldens[fp][key]
        match = g == result
        ok &= match
        print(f"golden {key}: greedy {'matches' if g['greedy'] == cont else 'DIFFERS'}, logits hash "
              f"{'matches' if g['logits_bf16'] == result['logits_bf16'] else 'DIFFERS'}", file=out)
    else:
        print(f"golden {key}: none recorded for this checkpoint ({fp}); --record-golden records one", file=out)
    print("VERIFY " + ("PASS" if ok else "FAIL"), file=out)
    return ok


def device_name(device):
    if device in (None, "cpu"):
        return "cpu"
    import torch
    return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
