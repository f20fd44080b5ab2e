"""The Mosaic GPU columns quantizer (``ops.gmm.fp8_quant_mgpu.quantize_columns``).

Legend: M rows, C columns (a [M, C]), Mb = M / 128.

On CPU it runs in Pallas GPU interpret mode (race detector on) and must equal
``ops.quant``'s 128x1 blockwise quantization, XLA's ``mosaic_fp8_tgmm.quantize_columns``
and the Triton kernel (``fp8_quant_kernels.quantize_columns``, interpreted) bit for
bit: the scale exponents come from the same helpers, so there is no tolerance. It
is also lowered for CUDA at wgrad's shapes (Mosaic's layout and transfer checks run
on the host). A GPU test repeats the bitwise comparison with the compiled kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import quant
from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu, mosaic, mosaic_fp8_tgmm
from mgpu_testing import bits as _bits, interpret as _interpret, races_found as _races_found
from mgpu_testing import same_bits as _same_bits, same_codes_outside

S = jax.ShapeDtypeStruct
B = 128


def _activations(rng, shape):
    """bf16 a [M, C] with every 128x1 block at its own magnitude (a random power of e per
    column and per 128-row band), and awkward blocks, each in its own (row band, column),
    spread over the column bands so that a swapped index shows:

      (0, 0)       all zero                 (0, 1)       one NaN
      (1, B + 2)   one +inf                 (2, 2)       one -inf
      (0, B + 4)   only float32-subnormal magnitudes (+-1e-40) and -0.0: amax reads as 0
      (1, 5)       amax 2^-120 (the exponent clamps at -126, scale 2^-126) with
                   subnormals and -0.0 mixed in: unflushed, 1e-40 * 2^126 would give a
                   nonzero code
      (1, 2B + 6)  +-bf16's largest finite value
      (0, 7)       amax exactly 448 * 2^-3 (codes of exactly 448)
      (2, 2B + 8)  an amax with mantissa just above 1.75 (the exponent steps up)
    """
    m, c = shape
    a = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (1, c)))
    a = a * np.repeat(np.exp(rng.uniform(-6, 6, (m // B, 1))), B, axis=0)
    tiny, big = 1e-40, float(jnp.finfo(jnp.bfloat16).max)
    rows = lambda i: slice(i * B, (i + 1) * B)  # noqa: E731
    a[rows(0), 0] = 0.0
    a[5, 1] = np.nan
    a[B + 3, B + 2] = np.inf
    a[2 * B + 100, 2] = -np.inf
    a[rows(0), B + 4] = rng.choice([tiny, -tiny, -0.0], B)
    a[rows(1), 5] = rng.uniform(-1, 1, B) * 2.0**-121
    a[B + 1:B + 9, 5] = [2.0**-120, tiny, -tiny, -0.0, tiny, 3 * tiny, -2 * tiny, 0.0]
    a[rows(1), 2 * B + 6] = rng.uniform(-1, 1, B) * big
    a[B, 2 * B + 6], a[B + 1, 2 * B + 6] = big, -big
    a[rows(0), 7] = rng.uniform(-1, 1, B) * 56.0
    a[2, 7] = -56.0
    a[rows(2), 2 * B + 8] = rng.uniform(-1, 1, B)
    a[2 * B + 3, 2 * B + 8] = 1.7578125 * 2.0**3  # mantissa 1.7578125 > 1.75, exact in bf16
    return jnp.asarray(a, jnp.bfloat16)


# M != C, with 6 row tiles and 3 column bands.
SHAPE = (6 * B, 3 * B)


@pytest.mark.parametrize("m_tiles", [8, 4, 2], ids=lambda t: f"m_tiles{t}")
def test_interpret_equals_quant_xla_and_triton_bit_for_bit(rng, m_tiles):
    """Codes and scales equal ``quant.quantize_blocks``'s 128x1 blocks (codes transposed),
    XLA's ``quantize_columns`` and the Triton kernel's on the awkward blocks of
    ``_activations``, with no race between the TMA copies and the smem reads and
    writes; with each CTA walking all 6 row tiles, 3 or 2 (2 and 3 CTAs per band)."""
    a = _activations(rng, SHAPE)
    with _interpret():
        got = jax.block_until_ready(fp8_quant_mgpu.quantize_columns(a, m_tiles=m_tiles))
    assert not _races_found()
    q, s = quant.quantize_blocks(a, (B, 1))
    _same_bits(got, (q.T, s))
    _same_bits(got, mosaic_fp8_tgmm.quantize_columns(a))
    _same_bits(got, fp8_quant_kernels.quantize_columns(a, interpret=True))
    scales = np.asarray(got[1])
    assert np.isnan(scales).sum() == 3
    assert np.isnan(scales[0, 1]) and np.isnan(scales[1, B + 2]) and np.isnan(scales[2, 2])
    assert scales[0, 0] == 1.0 and scales[0, B + 4] == 1.0 and scales[1, 5] == 2.0**-126
    assert not _bits(got[0])[5, B + 2:B + 9].any()  # the subnormals flushed to +0
    assert np.abs(np.asarray(got[0][7, :B]).astype(np.float32)).max() == 448.0
    assert scales[2, 2 * B + 8] == 2.0**-4  # 1.7578125 * 2^3 / 2^-5 = 450 > 448: not 2^-5


def test_interpret_pipeline_depths_agree(rng):
    """``max_concurrent_steps`` and ``out_slots`` change how the tiles flow, not the
    bits: one tile in flight with two store slots, and three with one, against the
    defaults, race-free, with each CTA walking 5 row tiles (more than either depth)."""
    a = _activations(rng, (5 * B, 3 * B))
    with _interpret():
        want = fp8_quant_mgpu.quantize_columns(a)
        got = [fp8_quant_mgpu.quantize_columns(a, max_concurrent_steps=1, out_slots=2),
               fp8_quant_mgpu.quantize_columns(a, max_concurrent_steps=3, out_slots=1)]
        jax.block_until_ready((want, got))
    assert not _races_found()
    for g_ in got:
        _same_bits(g_, want)


def test_inside_shard_map_equals_outside(rng):
    """wgrad quantizes x and dy inside ``jax.shard_map`` (check_vma on): the outputs must
    be typed as varying like a, and equal the bits outside."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))
    a = _activations(rng, SHAPE)
    with _interpret():
        inside = jax.jit(jax.shard_map(fp8_quant_mgpu.quantize_columns, mesh=mesh,
                                       in_specs=P("x"), out_specs=(P(None, "x"), P("x"))))(
            jax.device_put(a, NamedSharding(mesh, P("x"))))
        _same_bits(inside, fp8_quant_mgpu.quantize_columns(a))


@pytest.mark.parametrize("shape", [(100, 128), (128, 200), (0, 128), (1, 128, 128)], ids=str)
def test_shape_errors(shape):
    with pytest.raises(ValueError, match=r"a must be \[M, C\] with M and C positive multiples of 128"):
        fp8_quant_mgpu.quantize_columns(jnp.zeros(shape, jnp.bfloat16))


def test_argument_errors():
    with pytest.raises(ValueError, match="a must be bfloat16, got float32"):
        fp8_quant_mgpu.quantize_columns(jnp.zeros((B, B), jnp.float32))
    for kw in ({"m_tiles": 0}, {"max_concurrent_steps": 0}, {"out_slots": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=0"):
            fp8_quant_mgpu.quantize_columns(jnp.zeros((B, B), jnp.bfloat16), **kw)


# wgrad's x and dy at 65536 tokens: DeepSeek-V3's hidden size (7168) and gate|up
# width (4096), Qwen3-30B-A3B's hidden size (2048).
@pytest.mark.parametrize("c", [7168, 4096, 2048])
def test_lowers_for_cuda(c):
    """One Mosaic GPU custom call (typed FFI) with E4M3 codes [C, M] and float32 scales
    [Mb, C]."""
    m = 65536
    exported = jax.export.export(jax.jit(fp8_quant_mgpu.quantize_columns), platforms=["cuda"])(
        S((m, c), jnp.bfloat16))
    assert exported.mlir_module().count("stablehlo.custom_call @mosaic_gpu_v2") == 1
    assert exported.out_avals == (jax.core.ShapedArray((c, m), jnp.float8_e4m3fn),
                                  jax.core.ShapedArray((m // B, c), jnp.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("shape", [(6 * B, 3 * B), (8192, 2048), (4096, 7168)], ids=str)
def test_gpu_equals_triton_and_xla_bit_for_bit(rng, shape):
    """On the hardware (what interpret mode cannot show: the compiled row reduction, the
    f32 -> E4M3 conversion instruction, subnormal handling of the GPU's float ops, the
    transposed ldmatrix loads, swizzled stores and the scale stores from the WGMMA row
    layout): the compiled kernel against the compiled Triton kernel and XLA's
    quantization, awkward blocks included, at several tile walks and pipeline depths."""
    a = _activations(rng, shape)
    mine = fp8_quant_mgpu.quantize_columns(a)
    _same_bits_but_nan_blocks(mine, fp8_quant_kernels.quantize_columns(a))
    for kw in ({"m_tiles": 1}, {"m_tiles": 3}, {"max_concurrent_steps": 1, "out_slots": 1},
               {"max_concurrent_steps": 3, "out_slots": 2}):
        _same_bits(fp8_quant_mgpu.quantize_columns(a, **kw), mine)
    # XLA's quantization: the same codes and scales, NaN where the kernel's are NaN
    # (compared as values: which NaN code the GPU's conversion writes is the kernel's own).
    for got, want in zip(mine, mosaic_fp8_tgmm.quantize_columns(a), strict=True):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))


def _same_bits_but_nan_blocks(mine, triton):
    """(codes [C, M], scales [Mb, C]) of the two kernels on the GPU: the same bits except
    the codes of the blocks whose scale is NaN, where this kernel writes NaN codes and the
    compiled Triton kernel -448 (its maximum ignores a NaN operand on the GPU; see
    ``test_fp8_quant_mgpu._same_bits_but_nan_blocks``). Dequantized, both are NaN."""
    _same_bits(mine[1:], triton[1:])
    nan_blocks = np.isnan(np.asarray(mine[1]))
    assert nan_blocks.sum() == 3  # _activations' NaN, +inf and -inf blocks
    mask = np.repeat(nan_blocks, B, axis=0).T  # [C, M]
    same_codes_outside(mine[0], triton[0], mask)
