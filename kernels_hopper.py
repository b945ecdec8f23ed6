"""Hopper variants, in Triton's Gluon dialect, of kernels_cuda.py's kernels where the lever is
something plain Triton cannot say: warpgroups doing different work at once (warp specialisation).

    sparse_mla_prefill   kernels_cuda.sparse_mla_prefill (and sparse_mla_decode where a query's set
                         stays whole) for C = 512 latent and R = 64 rope values a row, 64 heads a
                         program, three warpgroups:
                           producer, bf16 rows           gathers the next selected rows into one of two
                             (_mla_gather)               shared buffers (cp.async; unselected rows zero-filled)
                           producer, packed FP8 rows     decodes in place into bf16 the codes consumer 1
                             (_mla_dequant)              copies into a stage (as bytes, their power-of-two
                                                         scales beside them), 16 rows at a time as they land
                           consumer 0 (_mla_scores_left, the scores z = q^C . c + q^R . k^R (wgmma), the
                             the default partition)      online softmax, p and alpha to shared memory,
                                                         o[:, :256] = alpha o + p c[:, :256]
                           consumer 1 (_mla_right)       o[:, 256:] = alpha o + p c[:, 256:]; for packed FP8
                                                         rows it also issues the copies, a step's as soon as
                                                         both consumers are through with its stage
                         so the gather (for packed FP8 rows the copies and the decoding), the score MMA and
                         half the value MMA of different steps overlap
                         (the split of FlashMLA's and TileLang's pipelined kernels, written here anew).
                                                                  reference: kernels_cuda._sparse_mla_kernel

The plain-Triton kernel stays: it is what the interpreter tests in CI and what every other GPU runs.
This one computes the same operations in the same order as the plain kernel with the latent whole
(halves=False, late_sum=False: its defaults for bf16 rows), so its bits equal that kernel's on an H200
(tests/test_kernels_hopper.py, GPU only): q^C against the latent as one chain of 32 k-steps from the
0 / -inf mask, q^R against the rope part from 0, their sum, scaled (the plain kernel's two warpgroups
run 32 of the 64 columns each; one warpgroup runs them all here, with the same products and sums per
element); the sum of p as the plain kernel forms it, each 32-column half summed and then the two (the
other half's entries masked to zeros, which adds nothing exactly); the value MMA from alpha * o, as
the plain kernel folds it; o / l with the same division. A packed FP8 row decodes to the same bf16
values either way (code times scale is exact). Its speed against the plain kernel and TileLang's:
bench/RESULTS.md.
`available(device)` says where it runs: an NVIDIA GPU of compute capability 9.x with a Triton that has
Gluon's Hopper API; kernels_cuda's sparse MLA calls it there for the shapes it takes (`takes(...)`)
at their default tiles, and the plain kernel otherwise.
"""
import functools

import torch

try:                                                   # Gluon as in Triton 3.6 to 3.9 (checked with both)
    import inspect
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # 3.9 / 3.6
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier                     # 3.9 / 3.6
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))    # 3.9 / 3.6
    if "functions_and_args" not in inspect.signature(gl.warp_specialize).parameters:   # 3.5's older form
        raise ImportError("gl.warp_specialize takes another form")
except (ImportError, AttributeError):                  # no Gluon, or another one: the plain kernel everywhere
    gluon = None

from kernels_fp8 import _interpreted, pdl
from quant import latent_width

USE_GLUON = True                                       # False: kernels_cuda's plain kernel on Hopper too

C_MLA, R_MLA, BLOCK_H, BLOCK_N = 512, 64, 64, 64       # the shapes this variant takes (V3.2-Exp's)
PACKED_BY_DEFAULT = True                               # kernels_cuda's default dispatch for packed FP8 rows


@functools.lru_cache(None)
def _hopper(index):
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def available(device):
    """Whether the Gluon variants run on this device (a Hopper GPU, Gluon present, not turned off)."""
    device = torch.device(device)
    return (USE_GLUON and gluon is not None and device.type == "cuda" and not _interpreted()
            and _hopper(device.index if device.index is not None else torch.cuda.current_device()))


def takes(qa, q_pe, cache, idx):
    """Whether sparse_mla_prefill here takes this call (shapes checked by kernels_cuda._check_mla): rows
    of C_MLA latent and R_MLA rope values, bf16 or packed FP8 (uint8, kernels_cuda.latent_width bytes),
    bf16 or float32 queries (taken to bf16 as the plain kernel does), heads in blocks of 64, a selection
    of at least one entry given, a sequence's rows and its (token, head) rows within 32-bit offsets.
    (Exact numerics' float32 rows: the plain kernel.)"""
    H, C, R = qa.shape[2], qa.shape[3], q_pe.shape[-1]
    width = latent_width(C, R) if cache.dtype == torch.uint8 else C + R   # bytes (packed) or values a row
    return (available(qa.device) and idx is not None and cache.dtype in (torch.bfloat16, torch.uint8)
            and qa.dtype in (torch.bfloat16, torch.float32) and q_pe.dtype in (torch.bfloat16, torch.float32)
            and cache.dim() == 3 and C == C_MLA and R == R_MLA and cache.shape[2] == width and H % BLOCK_H == 0
            and idx.shape[-1] >= 1 and cache.shape[1] * width < 2 ** 31
            and qa.shape[0] * qa.shape[1] * H < 2 ** 31)


if gluon is not None:
    @gluon.jit
    def _await_inputs(PDL: gl.constexpr):  # kernels_fp8._await_inputs in Gluon: each kernel's first statement
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    # -------------------------------------------------------------------------
    # sparse MLA prefill, warp-specialised. Shared memory (bf16): q^C [64, 512] as two 256-column
    # halves, q^R [64, 64], two stages of gathered rows (latent halves [64, 256] x 2, rope [64, 64]),
    # p [64, 64], alpha and 1 / l [64] in float32: 225 KB of the H200's 227. Registers (of 168 a thread
    # on average): consumer 0 240 (o's half, the score tile), consumer 1 168, the producer 96; for packed
    # FP8 rows consumer 1 192 (it issues the copies too), the producer 72.

    # Packed FP8 rows. A half [BN, 256] bf16 of a stage, in its NVMMA layout with 128-byte swizzling, is four
    # [BN, 64] column tiles of 128-byte lines, tile after tile; a row's 256 values fill its own line in each
    # tile. The rows' codes for that half (two groups of 128) land as bytes in their lines of tiles 0 and 1,
    # and the rows' four scales in the first 16 bytes of their line in tile 2, so a row decodes over its own
    # bytes. Layouts (four warps): BYTES, WORDS the half as plain bytes or words; CP [2, 16, 128] code copies (16
    # bytes a thread); SC [32, 4] scale copies; DEC [8, 2, 128] decoding (16 codes a thread); ROPE [16, 64].
    BYTES = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
    WORDS = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    CP = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 4, 8], [1, 4, 1], [2, 1, 0]))
    SC = gl.constexpr(gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0]))
    DEC = gl.constexpr(gl.BlockedLayout([1, 1, 16], [2, 2, 8], [4, 1, 1], [2, 1, 0]))
    ROPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def _mla_gather(kv_l, kv_r, kv_pe, ready, free, KV, SEL, hi, steps,
                    C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr):
        """Producer warpgroup: step i's selected rows -> stage i % 2 (cp.async, unselected rows zero-filled)."""
        CH: gl.constexpr = C // 2
        LAT: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])   # [4, 256] a pass: 16 B a thread
        n_lat = gl.arange(0, BN, layout=gl.SliceLayout(1, LAT))
        n_rope = gl.arange(0, BN, layout=gl.SliceLayout(1, ROPE))
        c_lat = gl.arange(0, CH, layout=gl.SliceLayout(0, LAT))
        c_rope = gl.arange(0, R, layout=gl.SliceLayout(0, ROPE))
        s_lat_next = gl.load(SEL + n_lat, mask=n_lat < hi, other=-1)   # selected positions (-1: none), each
        s_rope_next = gl.load(SEL + n_rope, mask=n_rope < hi, other=-1)  # step's loaded one step early
        for i in range(steps):
            st = i % 2
            s_lat, s_rope = s_lat_next, s_rope_next
            n_lat += BN
            n_rope += BN
            s_lat_next = gl.load(SEL + n_lat, mask=n_lat < hi, other=-1)
            s_rope_next = gl.load(SEL + n_rope, mask=n_rope < hi, other=-1)
            at_lat = KV + gl.expand_dims(gl.where(s_lat >= 0, s_lat, 0) * (C + R), 1) + gl.expand_dims(c_lat, 0)
            at_rope = (KV + gl.expand_dims(gl.where(s_rope >= 0, s_rope, 0) * (C + R), 1) + C
                       + gl.expand_dims(c_rope, 0))
            ok_lat = gl.expand_dims(s_lat >= 0, 1)
            ok_rope = gl.expand_dims(s_rope >= 0, 1)
            mbarrier.wait(free.index(st), ((i // 2) & 1) ^ 1)          # both consumers are done with it
            _async_load(kv_l.index(st), at_lat, mask=ok_lat)
            _async_load(kv_r.index(st), at_lat + CH, mask=ok_lat)
            _async_load(kv_pe.index(st), at_rope, mask=ok_rope)
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)   # each thread, once its copies land

    @gluon.jit
    def _mla_dequant(kv_l, kv_r, ready, landed, steps, BN: gl.constexpr):
        """Producer warpgroup for packed FP8 rows (C e4m3 codes, C / 128 power-of-two float32 scales, R
        bf16 rope values: kernels_cuda.latent_width bytes): decodes step i's rows in stage i % 2 as they
        land, 16 at a time (consumer 1 copies them in, _mla_right: each half's codes as bytes in that
        half, the scales beside them, the rope values in place). A chunk, once landed, is read whole (both
        halves' codes and their scales) into registers and written decoded over its own rows' lines; once
        all four are, ready[st] is told."""
        RC: gl.constexpr = BN // 4                                     # rows a chunk
        for i in range(steps):
            st = i % 2
            for k in gl.static_range(4):                               # step i's chunks as they land
                mbarrier.wait(landed.index(4 * st + k), (i // 2) & 1)
                _decode_chunk(kv_l.index(st), kv_r.index(st), k * RC, RC)
            fence_async_shared()                                       # the stores, for the consumers' wgmma
            _cta_barrier()                                             # all four warps' stores
            mbarrier.arrive(ready.index(st), count=1)

    @gluon.jit
    def _as_bytes(half):
        """A stage's half [BN, 256] bf16 as bytes [4, BN, 128] (column tile, row, byte)."""
        if _PUBLIC_REINTERPRET:                                        # Triton 3.9 / 3.6
            return half.reinterpret(gl.uint8, [4, half.shape[0], 128], BYTES)
        else:
            return half._reinterpret(gl.uint8, [4, half.shape[0], 128], BYTES)

    @gluon.jit
    def _scale_words(half):
        """A stage's half [BN, 256] bf16 as float32 words, column tile 2's lines [BN, 32] (where the scales land)."""
        BN: gl.constexpr = half.shape[0]
        if _PUBLIC_REINTERPRET:
            words = half.reinterpret(gl.float32, [4 * BN, 32], WORDS)
        else:
            words = half._reinterpret(gl.float32, [4 * BN, 32], WORDS)
        return words.slice(2 * BN, BN, dim=0)

    @gluon.jit
    def _issue_step(left, right, pe, landed, st, KV8, KV32, KV16, s_pe, s_sc, s0, s1, s2, s3, C: gl.constexpr,
                    R: gl.constexpr, W: gl.constexpr):
        """cp.async a step's selected rows (positions as _step_rows gives them) into a stage: the rope values
        -> pe, the scales -> both halves' tile 2, codes 0 .. C/2 - 1 -> left and the rest -> right as bytes;
        16 rows a chunk, landed[4 st + k] told (each thread's arrival) once chunk k's copies and those before land."""
        c = gl.arange(0, R, layout=gl.SliceLayout(0, ROPE))
        _async_load(pe, KV16 + gl.expand_dims(gl.where(s_pe >= 0, s_pe, 0).to(gl.int64) * (W // 2), 1)
                    + (C + 4 * (C // 128)) // 2 + gl.expand_dims(c, 0), mask=gl.expand_dims(s_pe >= 0, 1))
        g = gl.arange(0, C // 128, layout=gl.SliceLayout(0, SC))
        at = KV32 + gl.expand_dims(gl.where(s_sc >= 0, s_sc, 0).to(gl.int64) * (W // 4) + C // 4, 1) + gl.expand_dims(g, 0)
        _async_load(_scale_words(left).slice(0, C // 128, dim=1), at, mask=gl.expand_dims(s_sc >= 0, 1))
        _async_load(_scale_words(right).slice(0, C // 128, dim=1), at, mask=gl.expand_dims(s_sc >= 0, 1))
        RC: gl.constexpr = s0.shape[0]
        _copy_codes(left, right, landed.index(4 * st), 0, KV8, s0, C, W)
        _copy_codes(left, right, landed.index(4 * st + 1), RC, KV8, s1, C, W)
        _copy_codes(left, right, landed.index(4 * st + 2), 2 * RC, KV8, s2, C, W)
        _copy_codes(left, right, landed.index(4 * st + 3), 3 * RC, KV8, s3, C, W)

    @gluon.jit
    def _step_rows(SEL, n0, hi, BN: gl.constexpr, RC: gl.constexpr):
        """A step's selected positions (-1: none) in the layouts of the rope, scale and code copies."""
        n = gl.arange(0, BN, layout=gl.SliceLayout(1, ROPE))
        s_pe = gl.load(SEL + n0 + n, mask=n0 + n < hi, other=-1)
        m = gl.arange(0, BN, layout=gl.SliceLayout(1, SC))
        s_sc = gl.load(SEL + n0 + m, mask=n0 + m < hi, other=-1)
        r = gl.arange(0, RC, layout=gl.SliceLayout(0, gl.SliceLayout(2, CP)))
        s0 = gl.load(SEL + n0 + r, mask=n0 + r < hi, other=-1)
        s1 = gl.load(SEL + n0 + RC + r, mask=n0 + RC + r < hi, other=-1)
        s2 = gl.load(SEL + n0 + 2 * RC + r, mask=n0 + 2 * RC + r < hi, other=-1)
        s3 = gl.load(SEL + n0 + 3 * RC + r, mask=n0 + 3 * RC + r < hi, other=-1)
        return s_pe, s_sc, s0, s1, s2, s3

    @gluon.jit
    def _copy_codes(left, right, landed, r0: gl.constexpr, KV8, s, C: gl.constexpr, W: gl.constexpr):
        """cp.async the codes of the rows at positions s [RC] (-1: none) -> rows r0 .. r0 + RC - 1 of both
        halves as bytes (a row's half, 256 codes, in its lines of column tiles 0 and 1); then landed told."""
        RC: gl.constexpr = s.shape[0]
        t = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, CP)))
        c = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP)))
        row = gl.expand_dims(gl.expand_dims(gl.where(s >= 0, s, 0).to(gl.int64) * W, 0), 2)
        at = KV8 + row + gl.expand_dims(gl.expand_dims(t * 128, 1), 2) + gl.expand_dims(gl.expand_dims(c, 0), 1)
        ok = gl.expand_dims(gl.expand_dims(s >= 0, 0), 2)
        _async_load(_as_bytes(left).slice(0, 2, dim=0).slice(r0, RC, dim=1), at, mask=ok)
        _async_load(_as_bytes(right).slice(0, 2, dim=0).slice(r0, RC, dim=1), at + C // 2, mask=ok)
        async_copy.mbarrier_arrive(landed, increment_count=False)     # each thread, once its copies land

    @gluon.jit
    def _decode_chunk(left, right, r0: gl.constexpr, n: gl.constexpr):
        """Rows r0 .. r0 + n - 1 of a stage, landed, decoded in place: each half's codes [n, 2, 128] (bytes,
        column tiles 0 and 1) times their groups' scales (words 0, 1 of tile 2 in the left half, 2, 3 in
        the right) -> bf16 [n, 256], exactly, as the plain kernel's _latent_cols (unselected rows landed
        as zeros and decode to zeros; exact: power-of-two scales). Both halves are read before either is
        written (a row's values fill its own lines), so the warpgroup waits once a chunk for its loads
        (Triton 3.6 also puts a barrier before the next chunk's loads, unable to tell the chunks' rows
        apart in these views; 3.9 does not)."""
        cl = _as_bytes(left).slice(0, 2, dim=0).slice(r0, n, dim=1).permute((1, 0, 2)).load(DEC)
        sl = _scale_words(left).slice(r0, n, dim=0).slice(0, 2, dim=1).load(gl.SliceLayout(2, DEC))
        cr = _as_bytes(right).slice(0, 2, dim=0).slice(r0, n, dim=1).permute((1, 0, 2)).load(DEC)
        sr = _scale_words(right).slice(r0, n, dim=0).slice(2, 2, dim=1).load(gl.SliceLayout(2, DEC))
        _cta_barrier()                                                 # every warp's codes and scales read
        left.slice(r0, n).store(_decoded(cl, sl))
        right.slice(r0, n).store(_decoded(cr, sr))

    @gluon.jit
    def _decoded(codes, scale):
        """e4m3 codes [n, 2, 128] (bytes) times their group's scale [n, 2] -> bf16 [n, 256], exactly."""
        x = (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 2)).to(gl.bfloat16)
        return gl.reshape(x, [codes.shape[0], 2 * codes.shape[2]])

    @gluon.jit
    def _mla_right(kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, free, landed, p_ready, p_free, done, O, head0, steps,
                   KV8, KV32, KV16, SEL, hi, C: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, W: gl.constexpr,
                   PACKED: gl.constexpr):
        """Consumer 1: o[:, 256:] = alpha o + p c[:, 256:] each step, then o / l. For packed FP8 rows it
        also copies the selected rows into the stages (the producer decodes them): steps 0 and 1 first,
        step i + 2 as soon as both consumers are through with step i, whose stage it takes. (kv_l, kv_pe,
        landed, KV8, KV32, KV16, SEL, hi, R, W: the copies', PACKED only.)"""
        CH: gl.constexpr = C // 2
        BN: gl.constexpr = kv_r.shape[1]
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CH, 16])
        acc = gl.zeros([BH, CH], gl.float32, ACC)
        if PACKED:
            RC: gl.constexpr = BN // 4
            s_pe, s_sc, s0, s1, s2, s3 = _step_rows(SEL, 0, hi, BN, RC)
            _issue_step(kv_l.index(0), kv_r.index(0), kv_pe.index(0), landed, 0, KV8, KV32, KV16,
                        s_pe, s_sc, s0, s1, s2, s3, C, R, W)
            s_pe, s_sc, s0, s1, s2, s3 = _step_rows(SEL, BN, hi, BN, RC)
            if steps > 1:
                _issue_step(kv_l.index(1), kv_r.index(1), kv_pe.index(1), landed, 1, KV8, KV32, KV16,
                            s_pe, s_sc, s0, s1, s2, s3, C, R, W)
            s_pe, s_sc, s0, s1, s2, s3 = _step_rows(SEL, 2 * BN, hi, BN, RC)
        for i in range(steps):
            st = i % 2
            mbarrier.wait(p_ready.index(0), i & 1)                     # p and alpha of step i (consumer 0
                                                                       # waited for the stage's rows before)
            fence_async_shared()
            alpha = alpha_s.load(gl.SliceLayout(1, ACC))
            acc = acc * gl.expand_dims(alpha, 1)
            acc = warpgroup_mma(p_s, kv_r.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(p_free.index(0), count=1)
            mbarrier.arrive(free.index(st), count=1)
            if PACKED:
                if i + 2 < steps:                                      # step i + 2 into step i's stage, once
                    mbarrier.wait(free.index(st), (i // 2) & 1)        # consumer 0 is through with it too
                    _issue_step(kv_l.index(st), kv_r.index(st), kv_pe.index(st), landed, st, KV8,
                                KV32, KV16, s_pe, s_sc, s0, s1, s2, s3, C, R, W)
                    s_pe, s_sc, s0, s1, s2, s3 = _step_rows(SEL, (i + 3) * BN, hi, BN, RC)
        mbarrier.wait(done.index(0), 0)                                # 1 / l
        inv = inv_s.load(gl.SliceLayout(1, ACC))
        rh = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ACC))
        rc = gl.arange(0, CH, layout=gl.SliceLayout(0, ACC))
        at = O + gl.expand_dims(rh.to(gl.int64) * C, 1) + CH + gl.expand_dims(rc, 0)
        gl.store(at, (acc * gl.expand_dims(inv, 1)).to(O.dtype.element_ty))

    @gluon.jit
    def _mla_scores_left(q_l, q_r, q_pe, kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, ready, free, p_ready, p_free,
                         done, SEL, O, LSE, head0, hi, steps, qk_scale,
                         C: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr):
        """Consumer 0 (the default partition): scores, online softmax, o[:, :256]; then l, 1 / l, lse."""
        CH: gl.constexpr = C // 2
        S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, CH, 16])
        acc = gl.zeros([BH, CH], gl.float32, ACC)
        m = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, S))
        l = gl.zeros([BH], gl.float32, gl.SliceLayout(1, S))
        zero = gl.zeros([BH, BN], gl.float32, S)
        rn = gl.arange(0, BN, layout=gl.SliceLayout(0, S))
        first = gl.expand_dims(rn < BN // 2, 0)                        # columns 0..31: the plain kernel's first
        for i in range(steps):                                         # warpgroup's half of the score tile
            st = i % 2
            s = gl.load(SEL + i * BN + rn, mask=i * BN + rn < hi, other=-1)
            z = zero + gl.expand_dims(gl.where(s >= 0, 0.0, float("-inf")), 0)   # 0 / -inf: selected or not
            mbarrier.wait(ready.index(st), (i // 2) & 1)
            fence_async_shared()
            kl, kr, kp = kv_l.index(st), kv_r.index(st), kv_pe.index(st)
            # the score MMAs, issued together and waited for once: q^C . c as one chain from the mask, q^R . k^R from 0
            z = warpgroup_mma(q_l, kl.permute((1, 0)), z, is_async=True)
            z = warpgroup_mma(q_r, kr.permute((1, 0)), z, is_async=True)
            r = warpgroup_mma(q_pe, kp.permute((1, 0)), zero, is_async=True)
            z, r = warpgroup_mma_wait(0, deps=[z, r])
            z = (z + r) * qk_scale                                     # qk_scale = softmax scale * log2(e)
            m_new = gl.maximum(m, gl.max(z, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)     # nothing valid yet: no NaN
            p = gl.exp2(z - gl.expand_dims(m_safe, 1))
            alpha = gl.exp2(m - m_safe)
            # the sum of p as the plain kernel adds it: each half's, then the two (adding zeros is exact)
            l = l * alpha + (gl.sum(gl.where(first, p, 0.0), 1) + gl.sum(gl.where(first, 0.0, p), 1))
            mbarrier.wait(p_free.index(0), (i & 1) ^ 1)                # consumer 1 has taken step i - 1's
            p_s.store(p.to(gl.bfloat16))
            alpha_s.store(alpha)
            fence_async_shared()
            mbarrier.arrive(p_ready.index(0), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, ACC)), 1)
            acc = warpgroup_mma(p_s, kl, acc, is_async=True)           # o[:, :256] += p c
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(free.index(st), count=1)
            m = m_new
        inv = 1.0 / gl.where(l > 0, l, 1.0)
        lse = gl.where(l > 0, m + gl.log2(gl.where(l > 0, l, 1.0)), float("-inf"))
        inv_s.store(inv)
        mbarrier.arrive(done.index(0), count=1)
        rh = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, S))
        gl.store(LSE + rh, lse)
        inv_a = gl.convert_layout(inv, gl.SliceLayout(1, ACC))
        ra = head0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ACC))
        rc = gl.arange(0, CH, layout=gl.SliceLayout(0, ACC))
        at = O + gl.expand_dims(ra.to(gl.int64) * C, 1) + gl.expand_dims(rc, 0)
        gl.store(at, (acc * gl.expand_dims(inv_a, 1)).to(O.dtype.element_ty))

    @gluon.jit
    def _sparse_mla_prefill_kernel(QA, QPE, KV, KV32, KV16, IDX, POS, O, LSE, T, H, KSEL, L, qk_scale,
                                   C: gl.constexpr, R: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
                                   PACKED: gl.constexpr, PDL: gl.constexpr = False):
        """Reference: kernels_cuda._sparse_mla_kernel with one split, the latent whole (HALVES off) and
        the softmax sum taken every step (LATE_SUM off), bit for bit: its defaults for bf16 rows (KV);
        for packed FP8 rows (KV as bytes, KV32 and KV16 the same rows as float32 and 16-bit words) the
        rows it decodes, the same values. One program per (query token, 64 heads)."""
        _await_inputs(PDL)
        CH: gl.constexpr = C // 2
        W: gl.constexpr = C + 4 * (C // 128) + 2 * R if PACKED else C + R   # a row's bytes (packed) or values
        bt, hb = gl.program_id(0), gl.program_id(1)
        b, t = bt // T, bt % T
        hi = gl.minimum(gl.load(POS).to(gl.int32) + t + 1, KSEL)      # at most position + 1 entries
        steps = gl.cdiv(hi, BN)
        head0 = bt * H + hb * BH                                       # this program's first (token, head) row
        # q^C and q^R -> shared memory as bf16 (the default warpgroup, before the split; 64 columns at a time)
        BIG: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rh = gl.arange(0, BH, layout=gl.SliceLayout(1, LD))
        rr = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
        q_l = gl.allocate_shared_memory(gl.bfloat16, [BH, CH], BIG)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BH, CH], BIG)
        for c0 in gl.static_range(0, CH, R):
            at = QA + gl.expand_dims((head0 + rh).to(gl.int64) * C, 1) + c0 + gl.expand_dims(rr, 0)
            q_l.slice(c0, R, dim=1).store(gl.load(at).to(gl.bfloat16))
            q_r.slice(c0, R, dim=1).store(gl.load(at + CH).to(gl.bfloat16))
        q_pe = gl.allocate_shared_memory(gl.bfloat16, [BH, R], BIG, gl.load(
            QPE + gl.expand_dims((head0 + rh).to(gl.int64) * R, 1) + gl.expand_dims(rr, 0)).to(gl.bfloat16))
        kv_l = gl.allocate_shared_memory(gl.bfloat16, [2, BN, CH], BIG)
        kv_r = gl.allocate_shared_memory(gl.bfloat16, [2, BN, CH], BIG)
        kv_pe = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], BIG)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], BIG)
        ROW: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        alpha_s = gl.allocate_shared_memory(gl.float32, [BH], ROW)
        inv_s = gl.allocate_shared_memory(gl.float32, [BH], ROW)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        landed = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())   # packed: 4 chunks a stage
        p_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2):
            if PACKED:
                mbarrier.init(ready.index(st), count=1)                # the producer, once its stores are done
                for k in gl.static_range(4):
                    mbarrier.init(landed.index(4 * st + k), count=128) # consumer 1's threads' copies
            else:
                mbarrier.init(ready.index(st), count=128)              # the producer's 128 threads' copies
            mbarrier.init(free.index(st), count=2)                     # both consumers
        mbarrier.init(p_ready.index(0), count=1)
        mbarrier.init(p_free.index(0), count=1)
        mbarrier.init(done.index(0), count=1)
        fence_async_shared()
        SEL = IDX + bt.to(gl.int64) * KSEL                             # this query's selected positions
        KV += b.to(gl.int64) * L * W                                   # this sequence's rows
        if PACKED:
            KV32 += b.to(gl.int64) * L * (W // 4)
            KV16 += b.to(gl.int64) * L * (W // 2)
            gl.warp_specialize([
                (_mla_scores_left, (q_l, q_r, q_pe, kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, ready, free, p_ready,
                                    p_free, done, SEL, O, LSE, head0, hi, steps, qk_scale, C, BH, BN)),
                (_mla_right, (kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, free, landed, p_ready, p_free, done, O, head0,
                              steps, KV, KV32, KV16, SEL, hi, C, R, BH, W, True)),
                (_mla_dequant, (kv_l, kv_r, ready, landed, steps, BN)),
            ], [4, 4], [192, 72])
        else:
            gl.warp_specialize([
                (_mla_scores_left, (q_l, q_r, q_pe, kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, ready, free, p_ready,
                                    p_free, done, SEL, O, LSE, head0, hi, steps, qk_scale, C, BH, BN)),
                (_mla_right, (kv_l, kv_r, kv_pe, p_s, alpha_s, inv_s, free, landed, p_ready, p_free, done, O, head0,
                              steps, KV, KV, KV, SEL, hi, C, R, BH, W, False)),
                (_mla_gather, (kv_l, kv_r, kv_pe, ready, free, KV, SEL, hi, steps, C, R, BN)),
            ], [4, 4], [168, 96])


def sparse_mla_prefill(qa, q_pe, cache, idx, scale, pos, out_dtype=torch.bfloat16):
    """kernels_cuda.sparse_mla_prefill's contract for what takes(...) accepts, the first query's position
    as an integer [1] tensor on the device -> (o [B, T, H, C], lse [B, T, H]): bit for bit the plain
    kernel with one split, halves=False and late_sum=False (for bf16 rows, its defaults)."""
    B, T, H, C = qa.shape
    if not takes(qa, q_pe, cache, idx):
        raise ValueError(f"kernels_hopper.sparse_mla_prefill: qa {tuple(qa.shape)} {qa.dtype}, q_pe {tuple(q_pe.shape)} "
                         f"{q_pe.dtype}, cache {tuple(cache.shape)} {cache.dtype} on {qa.device} is not what it takes")
    packed = cache.dtype == torch.uint8
    cache = cache.contiguous()
    kv32, kv16 = (cache.view(torch.float32), cache.view(torch.bfloat16)) if packed else (cache, cache)
    o = torch.empty(B * T, H, C, dtype=out_dtype, device=qa.device)
    lse = torch.empty(B * T, H, dtype=torch.float32, device=qa.device)
    _sparse_mla_prefill_kernel[(B * T, H // BLOCK_H)](
        qa.contiguous(), q_pe.contiguous(), cache, kv32, kv16, idx.to(torch.int32).contiguous(), pos, o, lse,
        T, H, idx.shape[-1], cache.shape[1], scale * 1.4426950408889634, C=C, R=q_pe.shape[-1], BH=BLOCK_H,
        BN=BLOCK_N, PACKED=packed, num_warps=4, maxnreg=168, **pdl())
    return o.reshape(B, T, H, C), lse.reshape(B, T, H)
