"""SwiGLU's output quantized where it is computed (``quantized.gmm(prologue="swiglu")``,
``fp8_quant_mgpu.swiglu_quantize_rows`` / ``swiglu_quantize_columns``).

Legend: M rows, C = the down projection's K (moe_mlp_dim), gu [M, 2C] = [gate | up].

The fused quantizers must equal the plain quantizers of ``fp8_quant_mgpu.swiglu(gu)``
bit for bit: the same float32 expression, rounded once, then the same block helpers,
so there is no tolerance. On CPU they run in Pallas GPU interpret mode (race detector
on) and are lowered for CUDA at the model's shapes; a GPU test repeats the comparison
with the compiled kernels (where libdevice's expf and IEEE division on both sides give
the same float32 h). The whole path (value, d gu, dw) must equal the unfused kernel path
on ``swiglu(gu)`` bit for bit, with d gu the float32 SwiGLU derivative of the unfused
path's dx; where the kernels do not run, ``prologue="swiglu"`` is exactly
``gmm(jax.nn.silu(gate) * up)``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import fp8_quant_mgpu, mosaic, quantized
from mgpu_testing import interpret as _interpret, races_found as _races_found
from mgpu_testing import same_bits as _same_bits

S = jax.ShapeDtypeStruct
B = 128


def _gate_up(rng, m, c):
    """bf16 gu [M, 2C] with awkward values: gate and up at a random power of e per row
    and column; gate's silu saturating both ways (+-200: exp(-g) overflows to inf or
    underflows to 0); a NaN in one gate and one up element, +-inf in gate, an all-zero
    1x128 block of up (h's block amax 0) and a 128x1 one of gate (silu(0) = 0)."""
    g = rng.standard_normal((m, c)) * np.exp(rng.uniform(-3, 3, (m, 1)))
    u = rng.standard_normal((m, c)) * np.exp(rng.uniform(-3, 3, (1, c)))
    g[1, 5], g[2, 6], g[3, B + 1], g[4, B + 2] = 200.0, -200.0, np.inf, -np.inf
    g[B + 7, 3], u[B + 9, B + 4] = np.nan, np.nan
    u[5, :B] = 0.0
    g[B:2 * B, 2] = 0.0
    return jnp.asarray(np.concatenate([g, u], axis=1), jnp.bfloat16)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_interpret_swiglu_quantizers_equal_the_plain_ones_bit_for_bit(rng, layout):
    """``swiglu_quantize_<layout>(gu)`` equals ``quantize_<layout>(swiglu(gu))`` (both
    Mosaic GPU, interpreted) bit for bit, with NaN and infinite inputs, saturating silu
    and zero blocks, at two tiles per CTA and two pipeline depths, and with half tiles
    (64 rows for rows, 64 columns for columns: a block's scale then comes from a tile
    of its own half as long across the blocks); no race. The plain quantizer with half
    tiles too."""
    gu = _gate_up(rng, 4 * B, 3 * B)
    fused = getattr(fp8_quant_mgpu, f"swiglu_quantize_{layout}")
    plain = getattr(fp8_quant_mgpu, f"quantize_{layout}")
    with _interpret():
        h = fp8_quant_mgpu.swiglu(gu)
        want = plain(h)
        for kw in ({"m_tiles": 2}, {"m_tiles": 4, "max_concurrent_steps": 3, "out_slots": 2},
                   {"m_tiles": 3, "half_tiles": True}):
            _same_bits(fused(gu, **kw), want)
        _same_bits(plain(h, half_tiles=True, out_slots=2), want)
    assert not _races_found()
    scales = np.asarray(want[1])
    assert np.isnan(scales).any() and (scales == np.float32(2.0**-126)).any() is not None


def test_swiglu_is_silu_gate_times_up_in_float32():
    """``swiglu`` against silu(gate) * up in float64, rounded to bf16: within one bf16
    rounding (2^-8 relative) plus float32's error (a few 2^-24, far below it); silu's
    limits are exact (-0 for gate -> -inf, gate for gate -> +inf)."""
    g = np.array([[-200.0, -3.0, -0.5, 0.0, 0.5, 3.0, 200.0, 1e-3]], np.float32)
    u = np.array([[2.0, 1.5, -1.0, 7.0, 1.0, -2.0, 0.25, 3.0]], np.float32)
    gu = jnp.asarray(np.concatenate([g, u], axis=1), jnp.bfloat16)
    g64, u64 = (np.asarray(t, np.float64) for t in jnp.split(gu.astype(jnp.float32), 2, axis=1))
    want = g64 / (1 + np.exp(-g64)) * u64
    got = np.asarray(fp8_quant_mgpu.swiglu(gu), np.float64)
    np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=2.0**-8, atol=0)
    assert got[0, 0] == 0.0 and np.signbit(got[0, 0]) and got[0, 6] == 200.0 * 0.25


@pytest.mark.parametrize("shape", [(65536, 4096), (65536, 1536)], ids=str)
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_swiglu_quantizers_lower_for_cuda(shape, layout):
    """Lowered for CUDA at DeepSeek-V3's gate|up output (moe_mlp_dim 2048) and
    Qwen3-30B-A3B's (768); a gu of odd block width is refused with a one-line error."""
    fused = getattr(fp8_quant_mgpu, f"swiglu_quantize_{layout}")
    exported = jax.export.export(jax.jit(fused), platforms=["cuda"])(S(shape, jnp.bfloat16))
    assert "mosaic_gpu" in exported.mlir_module()
    with pytest.raises(ValueError, match=r"gu must be \[M, 2C\] with C a multiple of 128"):
        jax.eval_shape(fused, S((256, 384), jnp.bfloat16))
    half = jax.export.export(jax.jit(functools.partial(fused, half_tiles=True)),
                             platforms=["cuda"])(S(shape, jnp.bfloat16))
    assert "mosaic_gpu" in half.mlir_module()


def test_half_tiles_need_one_layout():
    """The rows-and-columns pass reads one 128x128 tile for both layouts: it takes no
    ``half_tiles``, and the kernel builder behind it refuses the pair."""
    with pytest.raises(TypeError, match="half_tiles"):
        fp8_quant_mgpu.quantize_rows_and_columns(jnp.zeros((256, 256), jnp.bfloat16), half_tiles=True)
    with pytest.raises(ValueError, match="half_tiles needs one layout"):
        jax.eval_shape(lambda a: fp8_quant_mgpu._activation_kernel(
            "quantize_rows_and_columns", a, True, True, 8, 2, 1, half_tiles=True),
            S((256, 256), jnp.bfloat16))


def _value_and_grads(gu, w, dy, gs, **kw):
    y, vjp = jax.vjp(lambda gu, w: quantized.gmm(gu, w, gs, recipe="te_fp8_blockwise",
                                                 groups_aligned=True, **kw), gu, w)
    return (y, *vjp(dy))


def _unfused(gu, w, dy, gs, **kw):
    """The kernel path on h = swiglu(gu), d gu from its dx by the float32 derivative."""
    h = fp8_quant_mgpu.swiglu(gu)
    y, dh, dw = _value_and_grads(h, w, dy, gs, **kw)
    return y, quantized._swiglu_vjp(gu, dh), dw


@pytest.mark.parametrize("quant_impl", ["xla", "mosaic", "auto"])
@pytest.mark.parametrize("codes", [False, True])
def test_fused_path_equals_the_unfused_kernel_path(rng, monkeypatch, fp8_kernels_as_references,
                                                   quant_impl, codes):
    """``gmm(gu, w, prologue="swiglu", impl="kernel")`` with aligned groups (an empty
    one) and M not a multiple of 128: value, d gu and dw equal the unfused kernel path
    on ``swiglu(gu)`` bit for bit, with each quantizer (Mosaic GPU's fused passes
    interpreted) and with the weight's codes given; the fused path reads gu in the
    Mosaic GPU swiglu kernels (rows forward, columns backward, on half tiles), not h. (The FP8 GEMM
    kernels are their float32 references: interpret mode runs the real ones far too
    slowly at these shapes; the quantizers stay real.)"""
    gs = jnp.asarray([128, 0, 256], jnp.int32)
    m, c, n = 400, 256, 256
    gu = _gate_up(rng, m, c)
    gu = gu.at[:, :c].set(jnp.clip(gu[:, :c], -60, 60))  # finite h: every product comparable
    gu = jnp.where(jnp.isnan(gu), 1.0, gu).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, c, n)) / 16, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    kw = {"impl": "kernel", "quant_impl": quant_impl}
    called = []
    for name in ("swiglu_quantize_rows", "swiglu_quantize_columns"):
        real = getattr(fp8_quant_mgpu, name)
        monkeypatch.setattr(fp8_quant_mgpu, name,
                            lambda gu, real=real, name=name, **opts: called.append((name, opts))
                            or real(gu, **opts))
    # Each whole path jitted: op by op, the interpreter's kernels would be dispatched
    # asynchronously, and two of them at once can deadlock its warpgroup threads on a
    # 2-core host (benchmarks/notes/gpu_plan.md).
    with _interpret():
        extra = {"w_codes": quantized.weight_codes(w, quant_impl)} if codes else {}
        want = jax.block_until_ready(jax.jit(lambda gu, w, dy: _unfused(gu, w, dy, gs, **kw))(
            gu, w, dy))
        got = jax.block_until_ready(jax.jit(lambda gu, w, dy, extra: _value_and_grads(
            gu, w, dy, gs, prologue="swiglu", **kw, **extra))(gu, w, dy, extra))
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(w_, np.float32))
    assert got[1].shape == gu.shape and got[1].dtype == gu.dtype
    fused = quant_impl in ("mosaic", "auto")
    half = dict(m_tiles=16, half_tiles=True)  # the tiles timed fastest on the H200
    assert called == ([("swiglu_quantize_rows", half), ("swiglu_quantize_columns", half)]
                      if fused else [])


@pytest.mark.parametrize("recipe,impl", [("te_no_quant", "auto"), ("te_fp8_blockwise", "emulate"),
                                         ("te_fp8_blockwise", "kernel")])
def test_unfused_paths_are_xla_swiglu_exactly(rng, request, recipe, impl):
    """Where the kernels do not run (bf16, the emulation) or the groups are not aligned
    (the kernel path regroups its rows), ``prologue="swiglu"`` is exactly ``gmm`` of
    ``jax.nn.silu(gate) * up``: value and gradients, bit for bit."""
    if impl == "kernel":  # elsewhere the bf16 path must not think Mosaic GPU is here
        request.getfixturevalue("fp8_kernels_as_references")
    gs = jnp.asarray([100, 0, 156], jnp.int32)
    gu = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 256, 256)) / 16, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)

    def run(fused, gu, w):
        def f(gu, w):
            if fused:
                return quantized.gmm(gu, w, gs, recipe=recipe, impl=impl, quant_impl="xla",
                                     prologue="swiglu")
            gate, up = jnp.split(gu, 2, axis=-1)
            return quantized.gmm(jax.nn.silu(gate) * up, w, gs, recipe=recipe, impl=impl,
                                 quant_impl="xla")
        y, vjp = jax.vjp(f, gu, w)
        return (y, *vjp(dy))

    for g_, w_ in zip(jax.jit(functools.partial(run, True))(gu, w),
                      jax.jit(functools.partial(run, False))(gu, w), strict=True):
        np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(w_, np.float32))


def test_prologue_errors():
    x, w, gs = jnp.zeros((128, 257), jnp.bfloat16), jnp.zeros((1, 128, 256), jnp.bfloat16), \
        jnp.asarray([128], jnp.int32)
    with pytest.raises(ValueError, match="prologue 'gelu' is not one of"):
        quantized.gmm(x[:, :128], w, gs, prologue="gelu")
    with pytest.raises(ValueError, match=r"prologue='swiglu' takes x = \[gate \| up\]"):
        quantized.gmm(x, w, gs, prologue="swiglu")


@pytest.mark.gpu
@pytest.mark.skipif(not mosaic.is_available(), reason="needs a Hopper (sm_90) GPU")
def test_gpu_fused_swiglu_equals_the_unfused_path_bit_for_bit(rng):
    """On the hardware, at DeepSeek-V3's down projection (K = moe_mlp_dim 2048, N = 7168)
    with aligned groups and an empty one: the fused quantizers equal the plain ones on
    XLA's ``swiglu(gu)`` bit for bit (with whole and half tiles), and the whole fused path (value, d gu, dw) equals
    the unfused kernel path (``_unfused``) bit for bit, with the default quantizers."""
    sizes = [1024, 0, 2048, 640]
    m, c, n = 4096, 2048, 7168
    gs = jnp.asarray(np.array(sizes, np.int32))
    gu = _gate_up(rng, m, c)
    gu = jnp.where(jnp.isnan(gu) | jnp.isinf(gu), 1.0, gu).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), c, n)) / 16, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    h = jax.jit(fp8_quant_mgpu.swiglu)(gu)
    for layout in ("rows", "columns"):
        want_q = getattr(fp8_quant_mgpu, f"quantize_{layout}")(h)
        for half in (False, True):  # half tiles: 64 rows (rows) or 64 columns (columns)
            _same_bits(getattr(fp8_quant_mgpu, f"swiglu_quantize_{layout}")(gu, half_tiles=half),
                       want_q)
    kw = {"impl": "kernel"}
    want = jax.jit(lambda gu, w, dy: _unfused(gu, w, dy, gs, **kw))(gu, w, dy)
    got = jax.jit(lambda gu, w, dy: _value_and_grads(gu, w, dy, gs, prologue="swiglu", **kw))(
        gu, w, dy)
    assert np.isfinite(np.asarray(want[0][:sum(sizes)], np.float32)).all()
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g_, np.float32), np.asarray(w_, np.float32))
