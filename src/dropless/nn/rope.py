"""Rotary position embeddings: YaRN-extended interleaved (DeepSeek-V2/V3) and plain rotate-half (Qwen3).

Legend: B batch, S sequence, H heads, R rotary head dim (``qk_rope_head_dim``,
even), R2 = R // 2 frequency pairs.

Plain RoPE rotates each pair of features (2j, 2j+1) of a head by the angle
``pos * theta**(-2j/R)``. YaRN ("YaRN: Efficient Context Window Extension of
Large Language Models", Peng et al. 2023) stretches a model trained at
``original_max_position_embeddings`` to ``rope_factor`` times that length:
high-frequency pairs (many rotations within the original window) keep their
frequency, low-frequency pairs are divided by ``rope_factor``, and pairs in
between are blended linearly over the band ``[beta_slow, beta_fast]`` rotations.
Attention logits are then multiplied by ``mscale**2`` (``yarn_softmax_scale``)
because stretched positions make the softmax flatter.

The formulas follow DeepSeek-V3's reference implementation (``model.py`` of
deepseek-ai/DeepSeek-V3), with the pair layout "interleaved" as there.
"""

import math

import jax
import jax.numpy as jnp

from dropless.config.sections import MLAConfig


def _correction_dim(num_rotations, dim, base, max_pos):
    """The feature index whose wavelength fits ``num_rotations`` times in ``max_pos``."""
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def plain_frequencies(dim: int, theta: float, name: str = "head_dim") -> jax.Array:
    """Plain RoPE's per-pair angular frequencies ``theta**(-2j/R)``, j < R/2, ``[R2]`` float32.

    Raises:
      ValueError: ``dim`` (the config key ``name``) is not a positive even number.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"{name}={dim} must be a positive even number")
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def cos_sin(positions_BS: jax.Array, freqs_R2: jax.Array, amplitude: float = 1.0):
    """cos and sin tables ``[B, S, R2]`` float32 of integer positions ``[B, S]``
    at frequencies ``[R2]``, both times ``amplitude``."""
    angles_BSR2 = positions_BS.astype(jnp.float32)[..., None] * freqs_R2
    return jnp.cos(angles_BSR2) * amplitude, jnp.sin(angles_BSR2) * amplitude


def inv_frequencies(cfg: MLAConfig) -> jax.Array:
    """Per-pair angular frequencies ``[R2]`` float32, YaRN-blended when rope_factor > 1.

    Raises:
      ValueError: ``qk_rope_head_dim`` is not a positive even number.
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs_R2 = plain_frequencies(dim, base, "qk_rope_head_dim")
    if cfg.rope_factor <= 1.0:
        return freqs_R2
    orig = cfg.original_max_position_embeddings
    low = max(math.floor(_correction_dim(cfg.beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(_correction_dim(cfg.beta_slow, dim, base, orig)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp_R2 = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    # smooth = 1 keeps the original (high) frequency; 0 divides it by the factor.
    smooth_R2 = 1.0 - ramp_R2
    return freqs_R2 / cfg.rope_factor * (1.0 - smooth_R2) + freqs_R2 * smooth_R2


def yarn_softmax_scale(cfg: MLAConfig) -> float:
    """Attention logit scale: ``qk_head_dim**-0.5``, times ``mscale**2`` under YaRN."""
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    m = yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim)
    return qk_head_dim**-0.5 * m * m


def rope_cos_sin(positions_BS: jax.Array, cfg: MLAConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables ``[B, S, R2]`` float32 for integer positions ``[B, S]``.

    Under YaRN both are multiplied by ``mscale(factor, mscale) / mscale(factor,
    mscale_all_dim)`` (1 when the two mscales are equal, as in DeepSeek-V3).
    """
    amp = yarn_mscale(cfg.rope_factor, cfg.mscale) / yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim)
    return cos_sin(positions_BS, inv_frequencies(cfg), amp)


def apply_rope(x_BSHR: jax.Array, cos_BSR2: jax.Array, sin_BSR2: jax.Array) -> jax.Array:
    """Rotate interleaved feature pairs of ``x [B, S, H, R]`` (H may be 1).

    Computed in float32 and returned in x's dtype: in bf16 the rotation of a
    long-context position loses most of its angle's precision.
    """
    dtype = x_BSHR.dtype
    x = x_BSHR.astype(jnp.float32).reshape(*x_BSHR.shape[:-1], -1, 2)
    x_even, x_odd = x[..., 0], x[..., 1]
    cos = cos_BSR2[:, :, None, :]
    sin = sin_BSR2[:, :, None, :]
    out = jnp.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], axis=-1)
    return out.reshape(x_BSHR.shape).astype(dtype)


# --- Plain RoPE, "rotate-half" pair layout (Llama, Qwen3 in transformers) -----
# Feature j is paired with feature j + R/2 (not 2j with 2j+1 as above); the two
# layouts are the same rotation applied to permuted features, so a checkpoint
# fixes which one its q/k projections expect.


def half_cos_sin(positions_BS: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables ``[B, S, R2]`` float32 of plain RoPE over ``head_dim`` = R features.

    Frequencies ``plain_frequencies``, as transformers' default rope; the
    tables are those of ``rope_cos_sin`` without YaRN (only the pair layout of
    ``apply_rope_half`` differs).

    Raises:
      ValueError: ``head_dim`` is not a positive even number.
    """
    return cos_sin(positions_BS, plain_frequencies(head_dim, theta))


def apply_rope_half(x_BSHR: jax.Array, cos_BSR2: jax.Array, sin_BSR2: jax.Array) -> jax.Array:
    """Rotate the pairs (j, j + R/2) of ``x [B, S, H, R]``: ``x cos + rotate_half(x) sin``.

    Computed in float32 and returned in x's dtype, as ``apply_rope``.
    """
    dtype = x_BSHR.dtype
    x = x_BSHR.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos = cos_BSR2[:, :, None, :]
    sin = sin_BSR2[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(dtype)
