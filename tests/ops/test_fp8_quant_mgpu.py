"""The Mosaic GPU weight quantizer (``ops.gmm.fp8_quant_mgpu``).

Legend: G groups, K x N the weight dims (w [G, K, N]).

On CPU it runs in Pallas GPU interpret mode (race detector on) and must equal
``ops.quant``'s 128x128 blockwise quantization and the Triton kernel
(``fp8_quant_kernels.quantize_weight``, interpreted) bit for bit: the scale
exponents come from the same helpers, so there is no tolerance. It is also
lowered for CUDA at DeepSeek-V3 and Qwen3 shapes (Mosaic's layout and transfer
checks run on the host). A GPU test repeats the bitwise comparison with the
compiled kernels on the hardware.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import quant
from dropless.ops.gmm import fp8_quant_kernels, fp8_quant_mgpu, mosaic, mosaic_fp8, quantized
from mgpu_testing import bits as _bits, interpret as _interpret, races_found as _races_found
from mgpu_testing import kernel_path, same_bits as _same_bits, same_codes_outside

S = jax.ShapeDtypeStruct
B = 128


def _weights(rng, shape):
    """bf16 w with every 128x128 block at its own magnitude (a random power of e per
    row and per column), and awkward blocks in group 0 (each in its own block):

      (0, 0)  all zero                    (0, 1)  one NaN
      (1, 0)  one +inf                    (1, 1)  one -inf
      (0, 2)  only float32-subnormal magnitudes (+-1e-40) and -0.0: amax reads as 0
      (1, 2)  amax 2^-120 (the exponent clamps at -126, scale 2^-126) with subnormals
              and -0.0 mixed in: unflushed, 1e-40 * 2^126 would give a nonzero code
      (0, 3)  +-bf16's largest finite value
      (1, 3)  amax exactly 448 * 2^-3 (codes of exactly 448) and, in group 1's
              block (0, 0), an amax with mantissa just above 1.75 (the exponent
              steps up)
    """
    g, k, n = shape
    a = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (g, 1, n)))
    a = a * np.exp(rng.uniform(-6, 6, (g, k, 1)))
    tiny, big = 1e-40, float(jnp.finfo(jnp.bfloat16).max)
    blk = lambda i, j: (0, slice(i * B, (i + 1) * B), slice(j * B, (j + 1) * B))  # noqa: E731
    a[blk(0, 0)] = 0.0
    a[0, 5, B + 7] = np.nan
    a[0, B + 3, 9] = np.inf
    a[0, B + 100, B + 50] = -np.inf
    a[blk(0, 2)] = rng.choice([tiny, -tiny, -0.0], (B, B))
    a[blk(1, 2)] = rng.uniform(-1, 1, (B, B)) * 2.0**-121
    a[0, B + 1, 2 * B + 1:2 * B + 9] = [2.0**-120, tiny, -tiny, -0.0, tiny, 3 * tiny, -2 * tiny, 0.0]
    a[blk(0, 3)] = rng.uniform(-1, 1, (B, B)) * big
    a[0, 0, 3 * B], a[0, 1, 3 * B] = big, -big
    a[blk(1, 3)] = rng.uniform(-1, 1, (B, B)) * 56.0
    a[0, B + 2, 3 * B + 2] = -56.0
    a[1, 0:B, 0:B] = rng.uniform(-1, 1, (B, B))
    a[1, 3, 4] = 1.7578125 * 2.0**3  # mantissa 1.7578125 > 1.75, exact in bf16
    return jnp.asarray(a, jnp.bfloat16)


@pytest.mark.parametrize("transposed", [True, False])
def test_interpret_equals_quant_and_triton_bit_for_bit(rng, transposed):
    """Codes (both layouts) and scales equal ``quant.quantize_blocks`` and the Triton
    kernel's on the awkward blocks of ``_weights``, with no race between the TMA
    copies and the smem reads and writes. K != N, so a swapped index shows."""
    w = _weights(rng, (2, 2 * B, 4 * B))
    with _interpret():
        got = jax.block_until_ready(fp8_quant_mgpu.quantize_weight(w, transposed=transposed))
    assert not _races_found()
    q, s = quant.quantize_blocks(w, (1, B, B))
    want = (q, jnp.swapaxes(q, 1, 2), s) if transposed else (q, s)
    _same_bits(got, want)
    _same_bits(got, fp8_quant_kernels.quantize_weight(w, transposed=transposed, interpret=True))
    scales = np.asarray(got[-1])
    assert np.isnan(scales[0, :2, :2]).sum() == 3 and scales[0, 0, 0] == 1.0
    assert scales[0, 0, 2] == 1.0 and scales[0, 1, 2] == 2.0**-126
    assert not _bits(got[0])[0, B + 1, 2 * B + 1:2 * B + 9][1:].any()  # flushed to +0


def test_interpret_pipeline_depths_agree(rng):
    """``max_concurrent_steps`` and ``out_slots`` change how the tiles flow, not the
    bits: one tile in flight with two store slots, and three with one, against the
    defaults, race-free, at G=1 with 5 tiles along N (more than either depth)."""
    w = _weights(rng, (2, 2 * B, 5 * B))[:1]
    with _interpret():
        want = fp8_quant_mgpu.quantize_weight(w)
        got = [fp8_quant_mgpu.quantize_weight(w, max_concurrent_steps=1, out_slots=2),
               fp8_quant_mgpu.quantize_weight(w, max_concurrent_steps=3, out_slots=1)]
        jax.block_until_ready((want, got))
    assert not _races_found()
    for g_ in got:
        _same_bits(g_, want)


def test_inside_shard_map_equals_outside(rng):
    """The MoE layer quantizes its experts' weights inside ``jax.shard_map`` (check_vma
    on): the outputs must be typed as varying like w, and equal the bits outside."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))
    w = _weights(rng, (2, 2 * B, 4 * B))[:1]
    with _interpret():
        inside = jax.jit(jax.shard_map(fp8_quant_mgpu.quantize_weight, mesh=mesh,
                                       in_specs=P("x"), out_specs=P("x")))(
            jax.device_put(w, NamedSharding(mesh, P("x"))))
        _same_bits(inside, fp8_quant_mgpu.quantize_weight(w))


def test_argument_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_quant_mgpu.quantize_weight(jnp.zeros((1, 100, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="must be bfloat16"):
        fp8_quant_mgpu.quantize_weight(jnp.zeros((1, 128, 128), jnp.float32))
    with pytest.raises(ValueError, match="out_slots=0"):
        fp8_quant_mgpu.quantize_weight(jnp.zeros((1, 128, 128), jnp.bfloat16), out_slots=0)


# DeepSeek-V3's gate|up (G=32, K=7168, N=4096) and Qwen3-30B-A3B's experts (G=128:
# K=2048, N=1536 and K=768, N=2048; the down projection's w is [G, 768, 2048]).
SHAPES = [(32, 7168, 4096), (128, 2048, 1536), (128, 768, 2048)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("transposed", [True, False])
def test_lowers_for_cuda(shape, transposed):
    """One Mosaic GPU custom call (typed FFI, the kind XLA's dynamic-slice fusion
    accepts) with E4M3 outputs of the right shapes."""
    g, k, n = shape
    fn = lambda w: fp8_quant_mgpu.quantize_weight(w, transposed=transposed)  # noqa: E731
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(S(shape, jnp.bfloat16))
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1
    outs = [S((g, k, n), jnp.float8_e4m3fn)] + [S((g, n, k), jnp.float8_e4m3fn)] * transposed
    assert exported.out_avals == tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in outs) + (
        jax.core.ShapedArray((g, k // B, n // B), jnp.float32),)


def test_mosaic_quant_impl_uses_the_mosaic_kernels_for_every_operand():
    """``quant_impl="mosaic"`` quantizes the weight with this kernel (fwd: both
    layouts; the backward reuses the forward's codes) and the activations with the
    Mosaic GPU rows, columns and fused kernels."""
    q = quantized.quantizer("mosaic")
    assert q.weight_both is fp8_quant_mgpu.quantize_weight
    assert q.weight.func is fp8_quant_mgpu.quantize_weight and q.weight.keywords == {"transposed": False}
    assert (q.rows, q.columns, q.rows_and_columns) == (
        fp8_quant_mgpu.quantize_rows, fp8_quant_mgpu.quantize_columns, fp8_quant_mgpu.quantize_rows_and_columns)


@pytest.mark.parametrize("aligned", [True, False])
def test_kernel_impl_with_mosaic_quantizers_equals_xla_quantizers(rng, fp8_kernels_as_references,
                                                                   aligned):
    """``quantized.gmm(impl="kernel", quant_impl="mosaic")``'s value and gradients equal
    ``quant_impl="xla"``'s bit for bit (the same codes and scales into the same
    products), with aligned groups (dy quantized into both layouts by one call) and
    without (wgrad's dy regrouped), on data whose magnitudes vary by e^+-6 per row and
    per column (so every block gets its own scale) with a zero group. The GEMM kernels
    are replaced by their float32 references; the quantizers run in interpret mode."""
    m, k, n = 384, 512, 256
    gs = jnp.asarray([128, 0, 256] if aligned else [100, 0, 284], jnp.int32)

    def wide(shape):
        a = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
        return jnp.asarray(a * np.exp(rng.uniform(-6, 6, shape[-1:])), jnp.bfloat16)

    x, w, dy = wide((m, k)), wide((3, k, n)), wide((m, n))

    run = kernel_path(x, w, dy, gs, aligned)

    with _interpret():
        got = jax.block_until_ready(run("mosaic"))
    assert not _races_found()
    for g_, w_ in zip(got, run("xla"), strict=True):
        np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(w_, np.float32))


def test_auto_quant_impl_is_mosaic_for_bf16_operands_and_triton_otherwise(monkeypatch):
    """``auto`` sends each bfloat16 operand (weights in both layouts, and activations to
    rows, columns or both) to this module's kernels and any other dtype to the Triton
    ones (these read bfloat16 only); the keyword arguments pass through."""
    calls = []
    ops = ("quantize_weight", "quantize_rows", "quantize_columns", "quantize_rows_and_columns")
    for mod in (fp8_quant_mgpu, fp8_quant_kernels):
        for op in ops:
            monkeypatch.setattr(mod, op, lambda a, _m=mod.__name__, _op=op, **kw: calls.append((_m, _op, kw)))
    quantized._quantizer.cache_clear()  # built afresh over the patched modules
    try:
        q = quantized.quantizer("auto")
        w16, w32 = jnp.zeros((1, B, B), jnp.bfloat16), jnp.zeros((1, B, B), jnp.float32)
        a16, a32 = jnp.zeros((B, B), jnp.bfloat16), jnp.zeros((B, B), jnp.float32)
        q.weight_both(w16)
        q.weight(w16)
        q.weight_both(w32)
        for fn in (q.rows, q.columns, q.rows_and_columns):
            fn(a16)
            fn(a32)
    finally:
        quantized._quantizer.cache_clear()
    mgpu, tri = fp8_quant_mgpu.__name__, fp8_quant_kernels.__name__
    assert calls == [(mgpu, "quantize_weight", {}), (mgpu, "quantize_weight", {"transposed": False}),
                     (tri, "quantize_weight", {}),
                     (mgpu, "quantize_rows", {}), (tri, "quantize_rows", {}),
                     (mgpu, "quantize_columns", {}), (tri, "quantize_columns", {}),
                     (mgpu, "quantize_rows_and_columns", {}), (tri, "quantize_rows_and_columns", {})]


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("shape", [(4, 1024, 2048), (2, 7168, 4096)], ids=str)
def test_gpu_equals_triton_and_xla_bit_for_bit(rng, shape):
    """On the hardware (what interpret mode cannot show: the compiled max reduction,
    the f32 -> E4M3 conversion instruction, subnormal handling of the GPU's float
    ops, the transposed ldmatrix loads and swizzled stores): the compiled kernel
    against the compiled Triton kernel and XLA's quantization, awkward blocks
    included, both layouts, at each pipeline depth."""
    w = _weights(rng, shape)
    mine = fp8_quant_mgpu.quantize_weight(w)
    triton = fp8_quant_kernels.quantize_weight(w)
    _same_bits_but_nan_blocks(mine, triton)
    _same_bits(fp8_quant_mgpu.quantize_weight(w, transposed=False), (mine[0], mine[2]))
    for steps, slots in ((1, 1), (3, 2)):
        _same_bits(fp8_quant_mgpu.quantize_weight(w, max_concurrent_steps=steps, out_slots=slots),
                   mine)
    # XLA's quantization: the same codes and scales, NaN where the kernel's are NaN
    # (compared as values: which NaN code the GPU's conversion writes is the kernel's own).
    q, s = mosaic_fp8.quantize_weight(w)
    for got, want in zip((mine[0], mine[2]), (q, s), strict=True):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(want.astype(jnp.float32)))


def _same_bits_but_nan_blocks(mine, triton):
    """(codes, transposed codes, scales) of the two kernels on the GPU: the same bits
    except the codes of the blocks whose scale is NaN (a NaN or infinity in the block),
    where this kernel writes NaN codes (``quant._saturate``'s rule, as XLA and interpret
    mode do) and the compiled Triton kernel writes -448: Triton's maximum ignores a NaN
    operand on the GPU, so ``clip(NaN, -448, 448)`` is -448 there (seen on the H200,
    ``benchmarks/results/logs/gpu-tests-fp8-quant-mgpu-20261202-1636-h200.log``).
    Dequantized, both are NaN: the block's scale multiplies every code."""
    _same_bits(mine[2:], triton[2:])
    nan_blocks = np.isnan(np.asarray(mine[2]))
    assert nan_blocks.sum() == 3  # _weights' NaN, +inf and -inf blocks
    nan_elems = np.repeat(np.repeat(nan_blocks, B, axis=1), B, axis=2)  # [G, K, N]
    for got, want, mask in ((mine[0], triton[0], nan_elems),
                            (mine[1], triton[1], np.swapaxes(nan_elems, 1, 2))):
        same_codes_outside(got, want, mask)


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("aligned", [False, True])
def test_gpu_kernel_path_with_auto_equals_pallas_bit_for_bit(rng, aligned):
    """The default ``auto`` (every bfloat16 operand on these kernels) against ``pallas``
    (Triton) through the whole FP8 kernel path on the hardware: value, dx and dw equal
    bit for bit, since both quantizers write the same codes and scales and the GEMM
    kernels are the same. Group sizes not multiples of 128 (wgrad regroups), an empty
    group, M not a multiple of 128 (rows padded); finite data (a NaN block's codes
    are the one documented difference)."""
    sizes = [384, 0, 256, 128] if aligned else [300, 0, 445, 128, 45]
    m, k, n, total = 1000, 512, 768, sum(sizes)
    gs = jnp.asarray(np.array(sizes, np.int32))
    wide = lambda shape: jnp.asarray(  # noqa: E731
        rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[:-1] + (1,))), jnp.bfloat16)
    x, w, dy = wide((m, k)), wide((len(sizes), k, n)) / 16, wide((m, n))

    run = kernel_path(x, w, dy, gs, aligned)

    got, want = run("auto"), run("pallas")
    assert all(bool(jnp.all(jnp.isfinite(v[:total].astype(jnp.float32)))) for v in got[:2])
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(g_), _bits(w_))
