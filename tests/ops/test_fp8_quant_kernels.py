"""The single-pass FP8 quantization kernels (``ops.gmm.fp8_quant_kernels``).

On CPU they run in Pallas interpret mode and must equal ``ops.quant``'s
blockwise quantization (the layouts the FP8 GEMM kernels read) bit for bit:
codes and power-of-two scales come from the same exponent arithmetic, so
there is no tolerance. They are also lowered for CUDA at DeepSeek-V3 shapes
(Triton IR built on the host). A GPU test repeats the bitwise comparison on
the hardware, where the compiled Triton kernels run.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import quant
from dropless.ops.gmm import fp8_quant_kernels as fq
from dropless.ops.gmm import mosaic, mosaic_fp8, mosaic_fp8_tgmm, quantized
from mgpu_testing import kernel_path

S = jax.ShapeDtypeStruct


def _data(rng, shape):
    """Normal values times a random power-of-e factor per row and per column (every
    block gets a different scale), with exact zeros and values below the smallest
    float32 normal (which ``quant`` reads as zero) mixed in."""
    a = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[-1]))
    a = a * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
    a[..., 0, :5] = 0.0
    a[..., 1, :3] = 1e-40
    return a


def _same(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    want = np.asarray(jnp.asarray(want).astype(jnp.float32))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_and_columns_equal_quant_bit_for_bit(rng, dtype):
    a = jnp.asarray(_data(rng, (256, 384)), dtype)
    q, s = fq.quantize_rows(a)
    want_q, want_s = quant.quantize_blocks(a, (1, 128))
    _same(q, want_q)
    _same(s, want_s.T)
    q, s = fq.quantize_columns(a)
    want_q, want_s = quant.quantize_blocks(a, (128, 1))
    _same(q, want_q.T)
    _same(s, want_s)


def test_weight_both_layouts_equal_quant_bit_for_bit(rng):
    w = jnp.asarray(_data(rng, (2, 256, 384)), jnp.bfloat16)
    q, q_t, s = fq.quantize_weight(w)
    want_q, want_s = quant.quantize_blocks(w, (1, 128, 128))
    _same(q, want_q)
    _same(q_t, jnp.swapaxes(want_q, 1, 2))
    _same(s, want_s)
    q2, s2 = fq.quantize_weight(w, transposed=False)
    _same(q2, want_q)
    _same(s2, want_s)


def test_nan_makes_its_block_nan(rng):
    """A NaN gives its block a NaN scale and NaN codes (``quantize_blocks``'s contract),
    whatever the backend's max reduction does with NaN; other blocks are untouched."""
    a = np.asarray(_data(rng, (128, 256)), np.float32)
    a[5, 200] = np.nan
    q, s = fq.quantize_rows(jnp.asarray(a))
    s = np.asarray(s)
    assert np.isnan(s[1, 5]) and np.isfinite(np.delete(s.ravel(), 1 * 128 + 5)).all()
    assert np.isnan(np.asarray(q[5, 128:].astype(jnp.float32))).all()
    q, s = fq.quantize_columns(jnp.asarray(a))
    s = np.asarray(s)
    assert np.isnan(s[0, 200]) and np.isfinite(np.delete(s.ravel(), 200)).all()


def test_shape_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        fq.quantize_rows(jnp.zeros((128, 200)), interpret=True)
    with pytest.raises(ValueError, match="multiples of 128"):
        fq.quantize_weight(jnp.zeros((1, 100, 128)), interpret=True)


def _bits(a):
    """a's bytes as unsigned integers: NaN codes and NaN scales compare bit for bit."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _same_bits(got, want):
    assert len(got) == len(want)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        np.testing.assert_array_equal(_bits(g_), _bits(w_))


def _special_blocks(rng, shape):
    """``_data`` plus an all-zero 128x128 block, and a NaN, a +inf and a -inf each in
    their own row block and column block (so each poisons one 1x128 and one 128x1
    block of its own)."""
    a = np.asarray(_data(rng, shape), np.float32)
    a[128:256, :128] = 0.0
    a[3, 130], a[140, 200], a[20, 250] = np.nan, np.inf, -np.inf
    return a


def test_fused_rows_and_columns_equal_the_two_kernels_bit_for_bit(rng):
    """``quantize_rows_and_columns`` returns exactly what ``quantize_rows`` and
    ``quantize_columns`` return, on blocks of every magnitude with zero, NaN and
    infinite blocks, at M != C. Bits, no tolerance: the same exponent arithmetic
    and an exact max. (In interpret mode ``num_warps`` is not used; the GPU test
    covers each warp count.)"""
    a = jnp.asarray(_special_blocks(rng, (384, 256)), jnp.bfloat16)
    rows, cols = fq.quantize_rows(a), fq.quantize_columns(a)
    assert np.isnan(np.asarray(rows[1])).sum() == 3 and np.isnan(np.asarray(cols[1])).sum() == 3
    _same_bits(fq.quantize_rows_and_columns(a), (*rows, *cols))


def test_fused_equals_quant_in_float32(rng):
    """On a float32 operand (no bf16 rounding first) the fused kernel equals
    ``ops.quant``, NaN, infinite and zero blocks included."""
    a = jnp.asarray(_special_blocks(rng, (256, 384)), jnp.float32)
    want_r, want_rs = quant.quantize_blocks(a, (1, 128))
    want_c, want_cs = quant.quantize_blocks(a, (128, 1))
    _same_bits(fq.quantize_rows_and_columns(a), (want_r, want_rs.T, want_c.T, want_cs))


def test_argument_errors():
    a = jnp.zeros((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_warps=2 is not one of"):
        fq.quantize_columns(a, interpret=True, num_warps=2)
    with pytest.raises(ValueError, match="num_warps=2 is not one of"):
        fq.quantize_rows_and_columns(a, interpret=True, num_warps=2)
    with pytest.raises(ValueError, match="multiples of 128"):
        fq.quantize_rows_and_columns(jnp.zeros((256, 100)), interpret=True)


def _abstract_h200():
    from jax._src import mesh as mesh_lib

    device = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def _export_for_cuda(fn, shape):
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with _abstract_h200():
        exported = jax.export.export(jax.jit(lambda a: fn(a, interpret=False)), platforms=["cuda"],
                                     disabled_checks=checks)(S(shape, jnp.bfloat16))
    return exported.mlir_module()


@pytest.mark.parametrize("name,shape", [("quantize_rows", (65536, 7168)),
                                        ("quantize_columns", (65536, 2048)),
                                        ("quantize_rows_and_columns", (65536, 7168)),
                                        ("quantize_weight", (32, 7168, 4096))])
def test_lowers_for_cuda(name, shape):
    text = _export_for_cuda(getattr(fq, name), shape)
    assert "xla.gpu.triton" in text and "f8E4M3FN" in text


def test_warp_counts_lower_for_cuda():
    """The columns and fused kernels lower to one Triton kernel each with the warp count
    asked for, 4 by default (the faster on the H200, ``fp8_quant_kernels.NUM_WARPS``);
    the rows and weight kernels keep 8."""
    for fn in (fq.quantize_columns, fq.quantize_rows_and_columns):
        text = _export_for_cuda(fn, (65536, 4096))
        assert text.count("xla.gpu.triton") == 1 and "num_warps = 4 " in text
        for num_warps in fq.NUM_WARPS:
            text = _export_for_cuda(functools.partial(fn, num_warps=num_warps), (65536, 4096))
            assert text.count("xla.gpu.triton") == 1 and f"num_warps = {num_warps} " in text
    assert "num_warps = 8 " in _export_for_cuda(fq.quantize_rows, (65536, 4096))
    assert "num_warps = 8 " in _export_for_cuda(fq.quantize_weight, (2, 1024, 4096))


def test_inside_shard_map_equal_outside(rng):
    """The MoE layer runs its experts inside ``jax.shard_map`` (check_vma on),
    where pallas_call needs each output's manual-axis type; the kernels must
    trace there and give the same bits as outside."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))
    a = jnp.asarray(_data(rng, (256, 384)), jnp.bfloat16)
    w = jnp.asarray(_data(rng, (2, 256, 384)), jnp.bfloat16)

    def body(a, w):
        return fq.quantize_rows(a), fq.quantize_columns(a), fq.quantize_weight(w)

    inside = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None), P(None)), out_specs=P()))(a, w)
    for got, want in zip(jax.tree.leaves(inside), jax.tree.leaves(body(a, w)), strict=True):
        _same(got, want)


def test_kernel_impl_with_pallas_quantizers_equals_xla_quantizers(rng, fp8_kernels_as_references):
    """``quantized.gmm(impl="kernel", quant_impl="pallas")``'s value and gradients equal
    ``quant_impl="xla"``'s bit for bit: the same codes and scales into the same
    products. The GEMM kernels are replaced by their float32 references here (the
    Mosaic GPU interpreter cannot run the Triton quantizers inside it); the kernels
    themselves are tested in test_gmm_mosaic_fp8."""
    m, k, n, sizes = 256, 256, 256, np.array([128, 0, 128], np.int32)
    gs = jnp.asarray(sizes)
    x = jnp.asarray(_data(rng, (m, k)), jnp.float32)
    w = jnp.asarray(_data(rng, (3, k, n)) / 1e3, jnp.float32)
    dy = jnp.asarray(_data(rng, (m, n)), jnp.float32)

    run = kernel_path(x, w, dy, gs, True)

    got, want = run("pallas"), run("xla")
    for g_, w_ in zip(got, want):
        _same(g_, w_)


@pytest.mark.parametrize("aligned", [True, False])
def test_backward_reads_dy_once_where_groups_are_aligned(fp8_kernels_as_references, aligned):
    """With ``groups_aligned`` the forward quantizes x once into both layouts and the
    backward dy (``rows_and_columns``), and the backward quantizes nothing else (wgrad
    reads x's 128x1 codes from the forward); without it wgrad's x and dy are regrouped
    copies, so their 128x1 copies come from passes of their own in the backward. (That
    the fused path gives the same bits:
    ``test_kernel_impl_with_pallas_quantizers_equals_xla_quantizers``.)"""
    calls = []

    def spy(name, fn):
        return lambda a: calls.append((name, a.shape)) or fn(a)

    q = quantized.quantizer("xla")
    q = q._replace(**{f: spy(f, getattr(q, f)) for f in ("rows", "columns", "rows_and_columns")})
    m, k, n = 256, 256, 512
    gs = jnp.array([128, 0, 128], jnp.int32)
    f = lambda x, w: quantized._kgmm(x, w, gs, jnp.float32, aligned, q, "default")  # noqa: E731
    y, vjp = jax.vjp(f, jnp.ones((m, k)), jnp.ones((3, k, n)))
    assert calls == [("rows_and_columns" if aligned else "rows", (m, k))]
    calls.clear()
    jax.eval_shape(vjp, y)
    if aligned:
        assert calls == [("rows_and_columns", (m, n))]
    else:
        p = 640  # align_groups' rows: M + G * 127 rounded up to 128
        assert sorted(calls) == [("columns", (p, k)), ("columns", (p, n)), ("rows", (m, n))]


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
def test_gpu_kernels_equal_quant_bit_for_bit(rng):
    """On the hardware: the compiled kernels (the columns and fused ones at each warp
    count) against XLA's quantization at a real shape."""
    a = jnp.asarray(_data(rng, (4096, 2048)), jnp.bfloat16)
    _same(fq.quantize_rows(a)[0], mosaic_fp8.quantize_rows(a)[0])
    _same(fq.quantize_rows(a)[1], mosaic_fp8.quantize_rows(a)[1])
    _same(fq.quantize_columns(a)[0], mosaic_fp8_tgmm.quantize_columns(a)[0])
    _same(fq.quantize_columns(a)[1], mosaic_fp8_tgmm.quantize_columns(a)[1])
    rows, cols = mosaic_fp8.quantize_rows(a), mosaic_fp8_tgmm.quantize_columns(a)
    for num_warps in fq.NUM_WARPS:
        _same_bits(fq.quantize_columns(a, num_warps=num_warps), cols)
        _same_bits(fq.quantize_rows_and_columns(a, num_warps=num_warps), (*rows, *cols))
    # NaN, infinite and zero blocks: each warp count's columns kernel against the
    # other's and the fused kernel against the two kernels (XLA's max reduction need
    # not propagate NaN, the kernels' does).
    b = jnp.asarray(_special_blocks(rng, (4096, 2048)), jnp.bfloat16)
    rows = fq.quantize_rows(b)
    cols = {w: fq.quantize_columns(b, num_warps=w) for w in fq.NUM_WARPS}
    _same_bits(cols[4], cols[8])
    for num_warps in fq.NUM_WARPS:
        _same_bits(fq.quantize_rows_and_columns(b, num_warps=num_warps), (*rows, *cols[num_warps]))
    w = jnp.asarray(_data(rng, (4, 1024, 2048)), jnp.bfloat16)
    q, q_t, s = fq.quantize_weight(w)
    want_q, want_s = mosaic_fp8.quantize_weight(w)
    _same(q, want_q)
    _same(q_t, jnp.swapaxes(want_q, 1, 2))
    _same(s, want_s)
