"""Rotary position embedding with YaRN context extension (DeepSeek-V3 report §2.1.1, YaRN paper),
as the official inference code computes it (spec/dsv32.md §3.3-3.4).

Two layouts of the same rotation, never one function with a flag:
- rope_interleaved rotates pairs (x0, x1), (x2, x3), ...: MLA's q_pe and k_pe;
- rope_half_split rotates (x[i], x[i + R/2]): the indexer's q and k (the official 2025-11-17 fix,
  "rope in indexer is not interleaved").

Letters: T positions, R rotary dims (qk_rope_head_dim), R/2 frequencies.
"""
import math

import numpy as np


def yarn_freqs(R, theta, max_seq_len, original_seq_len, factor, beta_fast, beta_slow):  # -> [R/2] f32
    """Per-pair frequencies; YaRN blends interpolated (freq / factor) and original frequencies by a
    linear ramp over the pairs between the two correction dims. Active only when the run's
    max_seq_len exceeds the original training length (the official condition)."""
    exponent = np.arange(0, R, 2, dtype=np.float32) / np.float32(R)      # 2i/R in fp32, as the demo
    # theta ** (2i/R): the demo's fp32 pow, made the same on every CPU by computing it in float64 and
    # rounding once (NumPy's own fp32 power takes other code paths on other CPUs, e.g. AVX512)
    power = np.array([math.pow(theta, float(e)) for e in exponent]).astype(np.float32)
    freqs = np.float32(1) / power
    if max_seq_len <= original_seq_len:
        return freqs

    def correction_dim(rotations):  # the pair index that turns `rotations` times over original_seq_len
        return R * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), R - 1)
    if low == high:
        high += 0.001                                                    # avoid a zero-width ramp
    ramp = np.clip((np.arange(R // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
    smooth = np.float32(1) - ramp                                        # 1: keep, 0: interpolate
    return (freqs / np.float32(factor) * (1 - smooth) + freqs * smooth).astype(np.float32)


def yarn_mscale(factor, mscale):  # attention temperature; enters the softmax scale squared
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_angles(freqs, positions):  # [R/2], [T] int -> cos, sin [T, R/2] float32
    """angle = fp32(t) * freq in fp32 (torch.outer of the demo); cos and sin rounded once to fp32."""
    angle = np.asarray(positions, np.float32)[:, None] * freqs[None, :]  # [T, R/2]
    return np.cos(angle.astype(np.float64)).astype(np.float32), np.sin(angle.astype(np.float64)).astype(np.float32)


def rope_interleaved(x, cos, sin):  # [B, T, H, R], [T, R/2], [T, R/2] -> [B, T, H, R] float32
    """(x[2i], x[2i+1]) as one complex number times e^{j angle}; the output stays interleaved."""
    x = np.asarray(x, np.float32)
    a, b = x[..., 0::2], x[..., 1::2]                                    # [B, T, H, R/2] each
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def rope_half_split(x, cos, sin):  # [B, T, H, R], [T, R/2], [T, R/2] -> [B, T, H, R] float32
    """(x[i], x[i + R/2]) as one complex number times e^{j angle} ("rotate_half", NeoX layout)."""
    x = np.asarray(x, np.float32)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)
