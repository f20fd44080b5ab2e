"""The Mosaic GPU rows quantizer and the fused rows-and-columns quantizer
(``ops.gmm.fp8_quant_mgpu.quantize_rows``, ``quantize_rows_and_columns``).

Legend: M rows, C columns (a [M, C]), Mb = M / 128, Cb = C / 128.

On CPU they run in Pallas GPU interpret mode (race detector on) and must equal
``ops.quant``'s 1x128 (and 128x1) blockwise quantization, XLA's
``mosaic_fp8.quantize_rows`` (and ``mosaic_fp8_tgmm.quantize_columns``) and the Triton
kernels (``fp8_quant_kernels``, interpreted) bit for bit: the scale exponents come
from the same helpers, so there is no tolerance. They are also lowered for CUDA at
the shapes the FP8 GEMMs quantize (Mosaic's layout and transfer checks run on the
host). A GPU test repeats the bitwise comparison with the compiled kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import quant
from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu, mosaic, mosaic_fp8, mosaic_fp8_tgmm
from mgpu_testing import bits as _bits, interpret as _interpret, races_found as _races_found
from mgpu_testing import same_bits as _same_bits, same_codes_outside

S = jax.ShapeDtypeStruct
B = 128


def _activations(rng, shape):
    """bf16 a [M, C] (M >= 6 * 128, C >= 3 * 128) at a random power of e per row and per
    column, with awkward 1x128 blocks (one row of a 128-column band) in the row bands 0-2
    and awkward 128x1 blocks (one column of a 128-row band) in the row bands 3-5, each
    block its own and the kinds spread over the column bands, so that a swapped index
    shows:

      1x128 (row, band)    128x1 (band, column)
      (3, 0)        (3, 0)         all zero
      (5, 1)        (3, 1)         one NaN
      (B+3, 2)      (4, B+2)       one +inf
      (2B+100, 0)   (5, 2)         one -inf
      (4, 1)        (3, B+4)       only float32-subnormal magnitudes (+-1e-40) and
                                   -0.0: amax reads as 0
      (B+5, 0)      (4, 5)         amax 2^-120 (the exponent clamps at -126, scale
                                   2^-126) with subnormals and -0.0 mixed in:
                                   unflushed, 1e-40 * 2^126 would give a nonzero code
      (B+6, 2)      (4, 2B+6)      +-bf16's largest finite value
      (7, 0)        (3, 7)         amax exactly 448 * 2^-3 (codes of exactly 448)
      (2B+8, 2)     (5, 2B+8)      an amax with mantissa just above 1.75 (the
                                   exponent steps up)

    A NaN or an infinity also makes the block of the other kind that holds it
    non-finite: each kind has 6 NaN scales.
    """
    m, c = shape
    a = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (1, c)))
    a = a * np.exp(rng.uniform(-6, 6, (m, 1)))
    tiny, big = 1e-40, float(jnp.finfo(jnp.bfloat16).max)
    band = lambda i: slice(i * B, (i + 1) * B)  # noqa: E731
    subnormals = [2.0**-120, tiny, -tiny, -0.0, tiny, 3 * tiny, -2 * tiny, 0.0]
    # 1x128 blocks
    a[3, band(0)] = 0.0
    a[5, B + 1] = np.nan
    a[B + 3, 2 * B + 2] = np.inf
    a[2 * B + 100, 2] = -np.inf
    a[4, band(1)] = rng.choice([tiny, -tiny, -0.0], B)
    a[B + 5, band(0)] = rng.uniform(-1, 1, B) * 2.0**-121
    a[B + 5, 1:9] = subnormals
    a[B + 6, band(2)] = rng.uniform(-1, 1, B) * big
    a[B + 6, 2 * B], a[B + 6, 2 * B + 1] = big, -big
    a[7, band(0)] = rng.uniform(-1, 1, B) * 56.0
    a[7, 2] = -56.0
    a[2 * B + 8, band(2)] = rng.uniform(-1, 1, B)
    a[2 * B + 8, 2 * B + 3] = 1.7578125 * 2.0**3  # mantissa 1.7578125 > 1.75, exact in bf16
    # 128x1 blocks
    a[band(3), 0] = 0.0
    a[3 * B + 5, 1] = np.nan
    a[4 * B + 3, B + 2] = np.inf
    a[5 * B + 100, 2] = -np.inf
    a[band(3), B + 4] = rng.choice([tiny, -tiny, -0.0], B)
    a[band(4), 5] = rng.uniform(-1, 1, B) * 2.0**-121
    a[4 * B + 1:4 * B + 9, 5] = subnormals
    a[band(4), 2 * B + 6] = rng.uniform(-1, 1, B) * big
    a[4 * B, 2 * B + 6], a[4 * B + 1, 2 * B + 6] = big, -big
    a[band(3), 7] = rng.uniform(-1, 1, B) * 56.0
    a[3 * B + 2, 7] = -56.0
    a[band(5), 2 * B + 8] = rng.uniform(-1, 1, B)
    a[5 * B + 3, 2 * B + 8] = 1.7578125 * 2.0**3
    return jnp.asarray(a, jnp.bfloat16)


def _check_rows_awkward(codes, scales):
    """The rows outputs (codes [M, C], scales [Cb, M]) on ``_activations``' 1x128 blocks."""
    scales = np.asarray(scales)
    assert np.isnan(scales).sum() == 6
    assert np.isnan(scales[1, 5]) and np.isnan(scales[2, B + 3]) and np.isnan(scales[0, 2 * B + 100])
    assert scales[0, 3] == 1.0 and scales[1, 4] == 1.0 and scales[0, B + 5] == 2.0**-126
    assert not _bits(codes)[B + 5, 2:9].any()  # the subnormals flushed to +0
    assert np.abs(np.asarray(codes[7, :B]).astype(np.float32)).max() == 448.0
    assert scales[2, 2 * B + 8] == 2.0**-4  # 1.7578125 * 2^3 / 2^-5 = 450 > 448: not 2^-5


def _check_columns_awkward(codes, scales):
    """The columns outputs (codes [C, M], scales [Mb, C]) on ``_activations``' 128x1 blocks."""
    scales = np.asarray(scales)
    assert np.isnan(scales).sum() == 6
    assert np.isnan(scales[3, 1]) and np.isnan(scales[4, B + 2]) and np.isnan(scales[5, 2])
    assert scales[3, 0] == 1.0 and scales[3, B + 4] == 1.0 and scales[4, 5] == 2.0**-126
    assert not _bits(codes)[5, 4 * B + 2:4 * B + 9].any()
    assert np.abs(np.asarray(codes[7, 3 * B:4 * B]).astype(np.float32)).max() == 448.0
    assert scales[5, 2 * B + 8] == 2.0**-4


# M != C, with 6 row tiles and 3 column bands.
SHAPE = (6 * B, 3 * B)


@pytest.mark.parametrize("m_tiles", [8, 4, 2], ids=lambda t: f"m_tiles{t}")
def test_rows_interpret_equals_quant_xla_and_triton_bit_for_bit(rng, m_tiles):
    """Codes and scales equal ``quant.quantize_blocks``'s 1x128 blocks (scales
    transposed), XLA's ``quantize_rows`` and the Triton kernel's on the awkward blocks of
    ``_activations``, with no race between the TMA copies and the smem reads and
    writes; with each CTA walking all 6 row tiles, 3 or 2 (2 and 3 CTAs per band)."""
    a = _activations(rng, SHAPE)
    with _interpret():
        got = jax.block_until_ready(fp8_quant_mgpu.quantize_rows(a, m_tiles=m_tiles))
    assert not _races_found()
    q, s = quant.quantize_blocks(a, (1, B))
    _same_bits(got, (q, s.T))
    _same_bits(got, mosaic_fp8.quantize_rows(a))
    _same_bits(got, fp8_quant_kernels.quantize_rows(a, interpret=True))
    _check_rows_awkward(*got)


@pytest.mark.parametrize("m_tiles", [8, 4, 2], ids=lambda t: f"m_tiles{t}")
def test_rows_and_columns_interpret_equals_quant_xla_and_triton_bit_for_bit(rng, m_tiles):
    """The four outputs equal ``quant.quantize_blocks``'s 1x128 blocks (scales
    transposed) and 128x1 blocks (codes transposed), XLA's ``quantize_rows`` and
    ``quantize_columns``, the fused Triton kernel's and this module's two kernels' on
    the awkward blocks of both kinds, race-free, at each tile walk."""
    a = _activations(rng, SHAPE)
    with _interpret():
        got = jax.block_until_ready(fp8_quant_mgpu.quantize_rows_and_columns(a, m_tiles=m_tiles))
        assert not _races_found()
        two = (*fp8_quant_mgpu.quantize_rows(a), *fp8_quant_mgpu.quantize_columns(a))
    qr, sr = quant.quantize_blocks(a, (1, B))
    qc, sc = quant.quantize_blocks(a, (B, 1))
    _same_bits(got, (qr, sr.T, qc.T, sc))
    _same_bits(got, (*mosaic_fp8.quantize_rows(a), *mosaic_fp8_tgmm.quantize_columns(a)))
    _same_bits(got, fp8_quant_kernels.quantize_rows_and_columns(a, interpret=True))
    _same_bits(got, two)
    _check_rows_awkward(*got[:2])
    _check_columns_awkward(*got[2:])


FUNCTIONS = [fp8_quant_mgpu.quantize_rows, fp8_quant_mgpu.quantize_rows_and_columns]
_name = lambda f: f.__name__  # noqa: E731


@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
def test_interpret_pipeline_depths_agree(rng, fn):
    """``max_concurrent_steps`` and ``out_slots`` change how the tiles flow, not the
    bits: one tile in flight with two store slots, and three with one, against the
    defaults, race-free, with each CTA walking 5 row tiles (more than either depth)."""
    a = _activations(rng, (6 * B, 3 * B))[:5 * B]
    with _interpret():
        want = fn(a)
        got = [fn(a, max_concurrent_steps=1, out_slots=2), fn(a, max_concurrent_steps=3, out_slots=1)]
        jax.block_until_ready((want, got))
    assert not _races_found()
    for g_ in got:
        _same_bits(g_, want)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
def test_inside_shard_map_equals_outside(rng, fn):
    """The forward's x and the backward's dy are quantized inside ``jax.shard_map``
    (check_vma on): the outputs must be typed as varying like a, and equal the bits
    outside."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))
    a = _activations(rng, SHAPE)
    rows_specs = (P("x"), P(None, "x"))
    out_specs = rows_specs if fn is fp8_quant_mgpu.quantize_rows else rows_specs + (P(None, "x"), P("x"))
    with _interpret():
        inside = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=out_specs))(
            jax.device_put(a, NamedSharding(mesh, P("x"))))
        _same_bits(inside, fn(a))


@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
@pytest.mark.parametrize("shape", [(100, 128), (128, 200), (0, 128), (1, 128, 128)], ids=str)
def test_shape_errors(fn, shape):
    with pytest.raises(ValueError, match=rf"{fn.__name__}: a must be \[M, C\] with M and C "
                                         r"positive multiples of 128"):
        fn(jnp.zeros(shape, jnp.bfloat16))


@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
def test_argument_errors(fn):
    with pytest.raises(ValueError, match=f"{fn.__name__}: a must be bfloat16, got float32"):
        fn(jnp.zeros((B, B), jnp.float32))
    for kw in ({"m_tiles": 0}, {"max_concurrent_steps": 0}, {"out_slots": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=0"):
            fn(jnp.zeros((B, B), jnp.bfloat16), **kw)


# The forward's x and the backward's dy at 65536 tokens: DeepSeek-V3's hidden size
# (7168) and gate|up width (4096), Qwen3-30B-A3B's hidden size (2048).
@pytest.mark.parametrize("fn", FUNCTIONS, ids=_name)
@pytest.mark.parametrize("c", [7168, 4096, 2048])
def test_lowers_for_cuda(fn, c):
    """One Mosaic GPU custom call (typed FFI) with E4M3 codes [M, C] and float32 scales
    [Cb, M] (and the columns' codes [C, M] and scales [Mb, C])."""
    m = 65536
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(S((m, c), jnp.bfloat16))
    assert exported.mlir_module().count("stablehlo.custom_call @mosaic_gpu_v2") == 1
    want = [((m, c), jnp.float8_e4m3fn), ((c // B, m), jnp.float32)]
    if fn is fp8_quant_mgpu.quantize_rows_and_columns:
        want += [((c, m), jnp.float8_e4m3fn), ((m // B, c), jnp.float32)]
    assert exported.out_avals == tuple(jax.core.ShapedArray(s_, d) for s_, d in want)


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("shape", [(6 * B, 3 * B), (8192, 2048), (4096, 7168)], ids=str)
def test_gpu_equals_triton_and_xla_bit_for_bit(rng, shape):
    """On the hardware (what interpret mode cannot show: the compiled row reductions,
    the f32 -> E4M3 conversion instruction, subnormal handling of the GPU's float ops,
    the plain and transposed ldmatrix loads, swizzled stores and the scale stores from
    the WGMMA row layout): both compiled kernels against the compiled Triton kernels
    and XLA's quantization, awkward blocks included, at several tile walks and
    pipeline depths, and the fused kernel against the rows and columns kernels."""
    a = _activations(rng, shape)
    rows = fp8_quant_mgpu.quantize_rows(a)
    both = fp8_quant_mgpu.quantize_rows_and_columns(a)
    _same_bits_but_nan_blocks(rows, fp8_quant_kernels.quantize_rows(a))
    _same_bits_but_nan_blocks(both, fp8_quant_kernels.quantize_rows_and_columns(a))
    _same_bits(both, (*rows, *fp8_quant_mgpu.quantize_columns(a)))
    for kw in ({"m_tiles": 1}, {"m_tiles": 3}, {"max_concurrent_steps": 1, "out_slots": 1},
               {"max_concurrent_steps": 3, "out_slots": 2}):
        _same_bits(fp8_quant_mgpu.quantize_rows(a, **kw), rows)
        _same_bits(fp8_quant_mgpu.quantize_rows_and_columns(a, **kw), both)
    # XLA's quantization: the same codes and scales, NaN where the kernels' are NaN
    # (compared as values: which NaN code the GPU's conversion writes is the kernel's own).
    xla = (*mosaic_fp8.quantize_rows(a), *mosaic_fp8_tgmm.quantize_columns(a))
    for got, want in zip(both, xla, strict=True):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))


def _same_bits_but_nan_blocks(mine, triton):
    """The rows outputs (codes [M, C], scales [Cb, M]), and the columns outputs (codes
    [C, M], scales [Mb, C]) after them if there, of the two kernels on the GPU: the same
    bits except the codes of the blocks whose scale is NaN, where this kernel writes NaN
    codes and the compiled Triton kernel -448 (its maximum ignores a NaN operand on the
    GPU; see ``test_fp8_quant_mgpu._same_bits_but_nan_blocks``). Dequantized, both are
    NaN."""
    assert len(mine) == len(triton)
    for n, (codes, scales) in enumerate(zip(mine[::2], mine[1::2], strict=True)):
        _same_bits((scales,), (triton[2 * n + 1],))
        nan_blocks = np.isnan(np.asarray(scales))
        assert nan_blocks.sum() == 6  # _activations' NaN, +inf and -inf blocks, each kind
        # rows: scales [Cb, M] -> codes [M, C]; columns: scales [Mb, C] -> codes [C, M]
        mask = np.repeat(nan_blocks, B, axis=0).T
        same_codes_outside(codes, triton[2 * n], mask)
