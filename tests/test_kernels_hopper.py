"""kernels_hopper.py's warp-specialised sparse MLA prefill (Gluon): compiled for sm_90 anywhere (shared memory,
no register spills), and on a Hopper GPU bit for bit the plain kernel of kernels_cuda.py with the latent whole
and within bf16's resolution of float64 attention over the decoded FP8 rows."""
import math

import pytest
from hypothesis import example, given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kernels_cuda
from bounds import loads_and_stores_in_bounds  # noqa: F401  (autouse: no address outside a kernel's arguments)
from conftest import gpu
from helpers import DEV

pytestmark = pytest.mark.slow      # the Triton kernels in the CPU interpreter: not in the fast loop (-m "not slow")


SM90_COMPILE = """
import json, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
import kernels_hopper as kh
from triton.backends.nvidia.compiler import get_ptxas                # the ptxas Triton uses for sm_90
fn = kh._sparse_mla_prefill_kernel
got = {}
for packed, q in ((False, "bf16"), (True, "fp32")):                  # bf16 rows; packed FP8 rows, float32 queries
    sig = dict(QA=f"*{q}", QPE=f"*{q}", KV="*u8" if packed else "*bf16", KV32="*fp32" if packed else "*bf16",
               KV16="*bf16", IDX="*i32", POS="*i32", O="*bf16", LSE="*fp32", T="i32", H="i32", KSEL="i32", L="i32",
               qk_scale="fp32")
    const = dict(C=kh.C_MLA, R=kh.R_MLA, BH=kh.BLOCK_H, BN=kh.BLOCK_N, PACKED=packed, PDL=True)
    src = GluonASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}},
                         constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in range(9)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168))
    ptx = Path(sys.argv[1]) / f"k{int(packed)}.ptx"
    ptx.write_text(k.asm["ptx"])
    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                       capture_output=True, text=True, check=True)
    got["packed" if packed else "bf16"] = dict(shared=k.metadata.shared, ptxas=r.stdout + r.stderr)
print(json.dumps(got))
"""


def test_sparse_mla_prefill_hopper_compiles_for_sm90(tmp_path):
    """kernels_hopper's Gluon kernel cannot run without a Hopper GPU, but it compiles anywhere: for sm_90
    with the installed Triton, within an H100 / H200 block's 227 KB of shared memory, and (the ptxas
    Triton ships and uses) without spilling registers. CI catches here a source or Triton change that breaks it.
    (In a process of its own: under TRITON_INTERPRET=1 Gluon's functions are the interpreter's.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    import kernels_hopper
    if kernels_hopper.gluon is None:
        pytest.skip("this Triton has no Gluon of the form kernels_hopper uses")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kernels_hopper.__file__).parent), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", SM90_COMPILE, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for rows in ("bf16", "packed"):                                     # its bf16 and its packed FP8 producer
        assert got[rows]["shared"] <= 232448, rows                      # bytes a block may have on sm_90
        assert " 0 bytes spill stores" in got[rows]["ptxas"], got[rows]["ptxas"]


def _packed_rows(B, L, C, R, g, exponents=(-20, 5)):
    """Packed FP8 latent rows with every e4m3 code but NaN (subnormals and zeros among them), power-of-two
    scales (2^-20 to 2^5), bf16 rope values: kernels_cuda.latent_width(C, R) bytes a row."""
    codes = torch.randint(0, 256, (B, L, C), generator=g, device=DEV, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)
    scales = torch.exp2(torch.randint(exponents[0], exponents[1] + 1, (B, L, C // 128), generator=g, device=DEV).float())
    pe = torch.randn(B, L, R, generator=g, device=DEV).bfloat16()
    return torch.cat([codes, scales.view(torch.uint8), pe.view(torch.uint8)], -1).contiguous()


@gpu
@settings(max_examples=16, deadline=None)
@given(st.integers(1, 2), st.integers(1, 40), st.sampled_from([64, 128]), st.integers(1, 3000), st.integers(0, 3000),
       st.sampled_from([1, 40, 64, 100, 512, 2048]), st.sampled_from([torch.bfloat16, torch.float32]),
       st.sampled_from(["bf16", "packed", "packed-wide"]), st.sampled_from([torch.bfloat16, torch.float32]),
       st.integers(0, 2 ** 31))
@example(1, 33, 128, 2500, 2000, 2048, torch.bfloat16, "bf16", torch.bfloat16, 0)     # 32 steps of 64 entries:
@example(1, 33, 128, 2500, 2000, 2048, torch.bfloat16, "packed", torch.float32, 0)    # both stages reused
def test_sparse_mla_prefill_hopper_equals_the_plain_kernel(B, T, H, L, past, K, out_dtype, rows, q_dtype, seed):
    """kernels_hopper's warp-specialised sparse MLA (Gluon) against the plain-Triton kernel it replaces on
    Hopper, with the latent whole (halves=False, late_sum=False: bf16 rows' default tiles): the same
    outputs and log-sum-exps bit for bit, at V3.2-Exp's widths (C = 512, R = 64), over bf16 rows and
    packed FP8 rows (every e4m3 code, power-of-two scales: its producer decodes them), bf16 or float32
    queries, for selections with -1 padding, rows with nothing selected, contexts shorter than K; and
    that the default dispatch of both entry points calls it (decode's where the set stays whole)."""
    import kernels_hopper
    if not kernels_hopper.available(DEV):
        pytest.skip("kernels_hopper runs on a Hopper GPU with Triton's Gluon")
    g = torch.Generator(device=DEV).manual_seed(seed)
    C, R = kernels_hopper.C_MLA, kernels_hopper.R_MLA
    past = past % L                                            # the first query's position
    T = min(T, L - past)
    if rows == "packed-wide":                                  # scales 2^-20 .. 2^5: every code's value, but
        cache = _packed_rows(B, L, C, R, g)                    # a softmax of one entry
    elif rows == "packed":                                     # scales 2^-9 .. 2^-7: a spread softmax
        cache = _packed_rows(B, L, C, R, g, exponents=(-9, -7))
    else:
        cache = (torch.randn(B, L, C + R, generator=g, device=DEV) * 2).bfloat16()
    qa = torch.randn(B, T, H, C, generator=g, device=DEV).to(q_dtype)
    qp = torch.randn(B, T, H, R, generator=g, device=DEV).to(q_dtype)
    idx = torch.full((B, T, K), -1, dtype=torch.int32, device=DEV)   # causal entries first, then -1
    for b in range(B):
        for t in range(T):
            n = int(torch.randint(0, min(K, past + t + 1) + 1, (1,), generator=g, device=DEV))
            idx[b, t, :n] = torch.randperm(past + t + 1, generator=g, device=DEV)[:n].int()
    args = (qa, qp, cache, idx, 0.07, past)
    assert kernels_hopper.takes(qa, qp, cache, idx)
    assert not kernels_hopper.takes(qa, qp, cache, idx[..., :0])    # no selected entry: the plain kernel
    o, lse = kernels_cuda.sparse_mla_prefill(*args, out_dtype=out_dtype, hopper=True)
    o_ref, lse_ref = kernels_cuda.sparse_mla_prefill(*args, out_dtype=out_dtype, hopper=False, halves=False,
                                                     late_sum=False)
    assert torch.equal(lse, lse_ref)
    assert torch.equal(o, o_ref), f"{(o != o_ref).float().mean().item():.2%} of the outputs differ"
    if rows == "bf16" or kernels_hopper.PACKED_BY_DEFAULT:      # the default dispatch takes the variant (counted:
        calls, variant = [], kernels_hopper.sparse_mla_prefill   # for bf16 rows the plain kernel has its bits)
        kernels_hopper.sparse_mla_prefill = lambda *a, **k: calls.append(1) or variant(*a, **k)
        try:                                                    # the position as a device tensor, int64 positions
            o_auto, _ = kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx.long(), 0.07, torch.tensor(past, device=DEV),
                                                        out_dtype=out_dtype)
            assert torch.equal(o_auto, o) and len(calls) == 1
            if kernels_cuda._default_splits(qa, idx, None) == 1:   # decode's set whole: the variant there too
                o_dec, lse_dec = kernels_cuda.sparse_mla_decode(*args, out_dtype=out_dtype)
                assert torch.equal(o_dec, o) and torch.equal(lse_dec, lse) and len(calls) == 2
        finally:
            kernels_hopper.sparse_mla_prefill = variant
    with pytest.raises(ValueError, match="idx"):                # the plain kernel's shape checks hold here too
        kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx[:, :0], 0.07, past, hopper=True)
    with pytest.raises(ValueError, match="hopper=True"):       # and where the variant does not apply, one line
        kernels_cuda.sparse_mla_prefill(*args, hopper=True, block_n=32)


@gpu
def test_sparse_mla_hopper_against_float64():
    """The variant over packed FP8 rows against float64 attention over the decoded rows (an oracle of
    its own, not the plain kernel): softmax(scale * (q^C . c + q^R . k^R)) c over each query's selection.
    Its only roundings are the bf16 queries (exact here), p taken to bf16 for the value MMA and
    float32 sums, so the outputs agree to bf16's resolution."""
    import kernels_hopper
    if not kernels_hopper.available(DEV):
        pytest.skip("kernels_hopper runs on a Hopper GPU with Triton's Gluon")
    g = torch.Generator(device=DEV).manual_seed(1)
    B, T, H, L, K, C, R = 2, 3, 128, 4096, 2048, kernels_hopper.C_MLA, kernels_hopper.R_MLA
    cache = _packed_rows(B, L, C, R, g, exponents=(-9, -7))          # values up to 3.5: a spread softmax
    scales = cache[..., C:C + 4 * (C // 128)].contiguous().view(torch.float32).double()
    codes = cache[..., :C].contiguous().view(torch.float8_e4m3fn).double()
    kv = (codes.reshape(B, L, C // 128, 128) * scales[..., None]).reshape(B, L, C)
    pe = cache[..., C + 4 * (C // 128):].contiguous().view(torch.bfloat16).double()
    qa = torch.randn(B, T, H, C, generator=g, device=DEV).bfloat16()
    qp = torch.randn(B, T, H, R, generator=g, device=DEV).bfloat16()
    idx = torch.stack([torch.stack([torch.randperm(L, generator=g, device=DEV)[:K] for _ in range(T)]) for _ in range(B)])
    idx[0, 1, 1000:] = -1                                      # a partial last step and -1 padding
    o, lse = kernels_cuda.sparse_mla_prefill(qa, qp, cache, idx.int(), 0.07, L - T, out_dtype=torch.float32, hopper=True)
    for b in range(B):
        for t in range(T):
            s = idx[b, t][idx[b, t] >= 0]
            z = (qa[b, t].double() @ kv[b, s].T + qp[b, t].double() @ pe[b, s].T) * 0.07   # [H, K]
            p = torch.softmax(z, -1)
            want = p @ kv[b, s]
            rel = ((o[b, t].double() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert rel < 1e-2, rel
            lse_want = torch.logsumexp(z, -1) / math.log(2)
            assert torch.allclose(lse[b, t].double(), lse_want, rtol=1e-5, atol=1e-3)
