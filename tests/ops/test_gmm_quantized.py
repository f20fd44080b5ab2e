"""ops.gmm.quantized: te_mxfp8 and te_fp8_blockwise grouped GEMMs, forward, dgrad and wgrad.

Legend: M rows, K contraction, N output features, G groups.

Each product is checked twice against float64 NumPy:

1. exactness of the emulation: the result equals the float64 product of the
   operands quantized by the independent model (``fp8_reference``) with the
   scale blocks along that product's contraction (x and w along K; dy and w
   along N; x and dy along M), up to float32 accumulation,
   ``(n + 1) 2^-23 |a^|.|b^|`` elementwise. With bfloat16 operands this is
   the claim that dequantizing to bf16 loses nothing, i.e. that the bf16
   GEMM computes what a native MXFP8 / FP8-blockwise GEMM computes up to
   accumulation order;
2. the recipe's error against the unquantized float64 product, within
   ``|ea|.|b| + |a|.|eb| + |ea|.|eb| + accumulation`` with the per-element
   bound e of ``fp8_reference.element_error_bound`` (E4M3: 2^-4 relative,
   2^-10 s absolute in the subnormal range, plus MX saturation).

Group sizes are multiples of the recipe's alignment, with an empty group;
rows past their sum are NaN in x and dy and must not leak.
"""

import dataclasses
import logging

import fp8_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import api, quantized

# recipe: (M, K, N, group sizes); K and N not multiples of the block, M with a tail.
CASES = {
    "te_mxfp8": (200, 96, 80, [32, 0, 96, 32]),
    "te_fp8_blockwise": (540, 160, 200, [128, 0, 256, 128]),
}


def _fwd(a, b, sizes):
    """y rows of group g = a rows @ b[g] (float64; rows past the total stay 0)."""
    out, start = np.zeros((a.shape[0], b.shape[2])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = a[start:start + n] @ b[g]
        start += n
    return out


def _dgrad(a, b, sizes):
    out, start = np.zeros((a.shape[0], b.shape[1])), 0
    for g, n in enumerate(sizes):
        out[start:start + n] = a[start:start + n] @ b[g].T
        start += n
    return out


def _wgrad(a, b, sizes):
    out, start = np.zeros((len(sizes), a.shape[1], b.shape[1])), 0
    for g, n in enumerate(sizes):
        out[g] = a[start:start + n].T @ b[start:start + n]
        start += n
    return out


def _model_qdq(a, recipe, axis):
    """(dequantized float64 operand, per-element error bound) from the NumPy model."""
    if recipe == "te_mxfp8":
        q, s = ref.quantize_mx(a, axis)
        block = tuple(32 if i == axis % a.ndim else 1 for i in range(a.ndim))
        scales = ref.mx_scales_f64(s)
    else:
        block = (1, 128, 128) if a.ndim == 3 else tuple(
            128 if i == axis % a.ndim else 1 for i in range(a.ndim))
        q, scales = ref.quantize_blocks(a, block)
    return (ref.dequantize(q, scales, a.shape, block),
            ref.element_error_bound(a, scales, block))


def _inputs(rng, recipe, dtype):
    m, k, n, sizes = CASES[recipe]
    total = sum(sizes)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1)))
    w = rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)
    dy = rng.standard_normal((m, n)) * np.exp(rng.uniform(-3, 3, (m, 1)))
    x, w, dy = (np.array(jnp.asarray(v, dtype).astype(jnp.float32)) for v in (x, w, dy))
    x[total:] = np.nan
    dy[total:] = np.nan
    return x, w, dy, np.asarray(sizes, np.int32), total


def _run(x, w, dy, sizes, recipe, dtype, backend="xla"):
    gs = jnp.asarray(sizes)

    def f(x, w):
        return quantized.gmm(x, w, gs, recipe=recipe, backend=backend, out_dtype=jnp.float32)

    y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    dx, dw = vjp(jnp.asarray(dy, jnp.float32))
    return (np.asarray(v, np.float64) for v in (y, dx, dw))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("recipe", sorted(CASES))
def test_products_exact_on_quantized_operands_and_within_bound(rng, recipe, dtype):
    x, w, dy, sizes, total = _inputs(rng, recipe, dtype)
    y, dx, dw = _run(x, w, dy, sizes, recipe, dtype)
    assert np.all(y[total:] == 0) and np.all(dx[total:] == 0)
    assert np.isfinite(dw).all()
    real = slice(0, total)
    xr, dyr = x[real], dy[real]
    fx_k, ex_k = _model_qdq(x, recipe, 1)
    fw_k, ew_k = _model_qdq(w, recipe, 1)
    fdy_n, edy_n = _model_qdq(dy, recipe, 1)
    fw_n, ew_n = _model_qdq(w, recipe, 2)
    fx_m, ex_m = _model_qdq(xr, recipe, 0)
    fdy_m, edy_m = _model_qdq(dyr, recipe, 0)
    n_acc = max(x.shape[1], dy.shape[1], total) + 1
    # y comes out in float32; dx and dw in the operands' dtype (unit roundoff 2^-8 in bf16).
    out_round = {"dgrad": 2.0**-8, "wgrad": 2.0**-8} if dtype == jnp.bfloat16 else {}
    checks = {  # product: (fn, got, a, ea, a^, b, eb, b^)
        "fwd": (_fwd, y[real], xr, ex_k[real], fx_k[real], w, ew_k, fw_k),
        "dgrad": (_dgrad, dx[real], dyr, edy_n[real], fdy_n[real], w, ew_n, fw_n),
        "wgrad": (_wgrad, dw, xr, ex_m, fx_m, dyr, edy_m, fdy_m),
    }
    for name, (fn, got, a, ea, qa, b, eb, qb) in checks.items():
        exact = fn(qa, qb, sizes)
        acc = n_acc * 2.0**-23 * fn(np.abs(qa), np.abs(qb), sizes)
        acc += out_round.get(name, 0.0) * np.abs(exact)
        assert np.all(np.abs(got - exact) <= acc), f"{name}: not the quantized product"
        err = np.abs(got - fn(a, b, sizes))
        bound = fn(ea, np.abs(b), sizes) + fn(np.abs(a), eb, sizes) + fn(ea, eb, sizes) + acc
        assert np.all(err <= bound), f"{name}: outside the {recipe} bound"
        assert np.max(err[bound > 0] / bound[bound > 0]) > 0.02, f"{name}: bound vacuous"


def test_wrong_blocking_is_detected(rng, monkeypatch):
    """Sanity of the check above: quantizing x along M for the forward product fails it."""
    recipe = "te_mxfp8"
    x, w, dy, sizes, total = _inputs(rng, recipe, jnp.float32)
    real_qdq = quantized.qdq
    monkeypatch.setattr(quantized, "qdq", lambda a, r, axis, out_dtype=None: real_qdq(
        a, r, 0 if a.ndim == 2 else axis, out_dtype))
    y, _, _ = _run(x, w, dy, sizes, recipe, jnp.float32)
    fx_k, _ = _model_qdq(x, recipe, 1)
    fw_k, _ = _model_qdq(w, recipe, 1)
    exact = _fwd(fx_k[:total], fw_k, sizes)
    acc = (x.shape[1] + 1) * 2.0**-23 * _fwd(np.abs(fx_k[:total]), np.abs(fw_k), sizes)
    assert not np.all(np.abs(y[:total] - exact) <= acc)


def test_reference_backend_agrees(rng):
    recipe = "te_fp8_blockwise"
    x, w, dy, sizes, total = _inputs(rng, recipe, jnp.float32)
    a = list(_run(x, w, dy, sizes, recipe, jnp.float32, backend="xla"))
    b = list(_run(x, w, dy, sizes, recipe, jnp.float32, backend="reference"))
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5 * np.max(np.abs(v)))


def test_no_quant_is_plain_gmm(rng):
    x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    gs = jnp.array([10, 0, 25], jnp.int32)
    np.testing.assert_array_equal(quantized.gmm(x, w, gs, recipe="te_no_quant", backend="xla"),
                                  api.gmm(x, w, gs, backend="xla"))


def test_alignment_and_errors():
    assert [quantized.required_alignment(r) for r in quantized.RECIPES] == [1, 128, 32]
    with pytest.raises(ValueError, match="not one of"):
        quantized.required_alignment("te_fp4")
    x, w = jnp.ones((64, 32)), jnp.ones((2, 32, 32))
    with pytest.raises(ValueError, match="not one of"):
        quantized.gmm(x, w, jnp.array([32, 32], jnp.int32), recipe="fp4")
    with pytest.raises(ValueError, match="contraction sizes differ"):
        quantized.gmm(x, jnp.ones((2, 16, 32)), jnp.array([32, 32], jnp.int32), recipe="te_mxfp8")


def test_emulation_is_logged_once(caplog):
    quantized._say_once.cache_clear()
    w, gs = jnp.ones((2, 32, 32)), jnp.array([32, 32], jnp.int32)
    with caplog.at_level(logging.WARNING, logger=quantized.__name__):
        for m in (64, 96, 128):  # three traces (eval_shape: no compile)
            jax.eval_shape(lambda x: quantized.gmm(x, w, gs, recipe="te_mxfp8", backend="xla"),
                           jax.ShapeDtypeStruct((m, 32), jnp.float32))
    msgs = [r.getMessage() for r in caplog.records if "MXFP8 is emulated" in r.getMessage()]
    assert len(msgs) == 1 and jax.devices()[0].device_kind in msgs[0]


def test_align_groups_by_hand():
    a = jnp.arange(1, 11, dtype=jnp.float32)[:, None] * jnp.array([[1.0, -1.0]])
    out, padded = quantized.align_groups(a, jnp.array([3, 0, 5, 1], jnp.int32), 4)
    # P = 10 + 4 * 3 = 22 -> 24 rows; groups at 0 (3 rows), 4 (5 rows), 12 (1 row).
    want = np.zeros((24, 2), np.float32)
    want[0:3], want[4:9], want[12] = a[0:3], a[3:8], a[8]
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(padded, [4, 0, 8, 4])


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_unaligned_groups_get_the_recipe_numerics_in_wgrad(rng, recipe):
    """Group sizes that are not multiples of the block: wgrad's blocks along M are
    taken within each group (as if each group were padded with zero rows), never
    across two groups."""
    sizes = [70, 0, 150, 33]
    m, k, n, total = 260, 64, 48, sum(sizes)
    # Each group 16x larger than the one before: a block straddling two groups would
    # take the larger group's scale and lose the smaller one's low bits.
    group_scale = np.repeat(16.0 ** np.arange(len(sizes)), sizes)
    group_scale = np.concatenate([group_scale, np.ones(m - total)])[:, None]
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-1, 1, (m, 1))) * group_scale
    dy = rng.standard_normal((m, n)) * np.exp(rng.uniform(-1, 1, (m, 1))) * group_scale
    w = rng.standard_normal((len(sizes), k, n))
    x[total:] = dy[total:] = np.nan
    x, dy, w = (np.asarray(v, np.float32) for v in (x, dy, w))
    _, _, dw = _run(x, w, dy, np.asarray(sizes, np.int32), recipe, jnp.float32)
    starts = np.cumsum([0] + sizes)
    for g, (a, b) in enumerate(zip(starts, starts[1:])):
        if a == b:
            np.testing.assert_array_equal(dw[g], 0.0)
            continue
        qx, _ = _model_qdq(x[a:b], recipe, 0)
        qdy, _ = _model_qdq(dy[a:b], recipe, 0)
        exact = qx.T @ qdy
        bound = (b - a + 1) * 2.0**-23 * (np.abs(qx).T @ np.abs(qdy))
        assert np.all(np.abs(dw[g] - exact) <= bound), f"group {g}"


def test_straddled_blocks_are_detected(rng, monkeypatch):
    """Sanity of the check above: wgrad with blocks across groups (a broken
    ``groups_aligned=True`` promise) fails it."""
    import functools

    monkeypatch.setattr(quantized, "gmm", functools.partial(quantized.gmm, groups_aligned=True))
    with pytest.raises(AssertionError, match="group"):
        test_unaligned_groups_get_the_recipe_numerics_in_wgrad(rng, "te_fp8_blockwise")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("recipe", ["te_fp8_blockwise", "te_mxfp8"])
def test_gpu_emulation_is_fp8_under_jit(rng, recipe):
    """What the CPU tests cannot show: under ``jit`` on the GPU the emulated recipe
    really quantizes. XLA:GPU folds an f32 -> f8 -> f32 round trip into the
    identity (float-conversion simplification), which once made the emulation
    compute plain bf16 products (relative difference 0.0 from bf16) while the
    log said FP8; ``quant.keep_codes`` prevents it.

    Checked on the default (Mosaic) bf16 kernel: the optimized HLO holds E4M3
    values; the forward equals the float64 product of the model-quantized
    operands within the tensor-core accumulation model of
    ``fp8_accumulation`` (a conservative bound for the bf16 kernel's float32
    accumulation); and it differs from the unquantized product by at least
    1e-2 relative (Frobenius): E4M3 rounds each operand by a relative error
    of RMS about 2.6e-2 (half an ulp, 2^-4 to 2^-3 of the value, uniform),
    so the product's error is about sqrt(2) * 2.6e-2 = 3.7e-2; plain bf16
    would be about 1e-6 away."""
    import fp8_accumulation as fp8_acc

    sizes = [512, 0, 1024, 512]
    m, k, n = 2048, 1024, 512
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1))),
                    jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    gs = jnp.asarray(np.array(sizes, np.int32))
    f = jax.jit(lambda x, w: quantized.gmm(x, w, gs, recipe=recipe, out_dtype=jnp.float32))
    assert "f8e4m3fn" in f.lower(x, w).compile().as_text()
    y = np.asarray(f(x, w), np.float64)
    x64, w64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (x, w))
    qx, _ = _model_qdq(x64, recipe, 1)
    qw, _ = _model_qdq(w64, recipe, 1)
    fp8_acc.check_product(_fwd, y, qx, qw, sizes, k // 128, recipe)
    plain = _fwd(x64, w64, sizes)
    assert np.linalg.norm(y - plain) >= 1e-2 * np.linalg.norm(plain)


def test_auto_impl_runs_the_kernels_only_where_they_can(monkeypatch):
    """``impl="auto"`` (the config's default): the FP8 kernels for te_fp8_blockwise when
    the bf16 backend resolves to mosaic and K, N are multiples of 256; else the
    emulation, with the reason (which the log line carries)."""
    from dropless.ops.gmm import mosaic

    x, w, bad_w = (65536, 7168), (32, 7168, 4096), (32, 7168, 384)
    resolve = lambda recipe, backend="auto", w=w: quantized.resolve_impl(  # noqa: E731
        "auto", recipe, backend, x, w, jnp.bfloat16)
    if not mosaic.is_available():  # this machine: no Hopper GPU
        impl, why = resolve("te_fp8_blockwise")
        assert impl == "emulate" and "backend is xla" in why
    monkeypatch.setattr(mosaic, "is_available", lambda: True)
    assert resolve("te_fp8_blockwise") == ("kernel", "")
    assert resolve("te_fp8_blockwise", backend="mosaic") == ("kernel", "")
    assert resolve("te_fp8_blockwise", backend="xla")[0] == "emulate"
    assert resolve("te_mxfp8")[0] == "emulate"
    impl, why = resolve("te_fp8_blockwise", w=bad_w)
    assert impl == "emulate" and "multiples of 256" in why
    for explicit in ("emulate", "kernel"):
        assert quantized.resolve_impl(explicit, "te_fp8_blockwise", "xla", x, bad_w, jnp.bfloat16) == (explicit, "")
    assert quantized.quantizer("auto") is quantized.quantizer("auto")  # a static argument
    assert quantized.quantizer("xla").name == "xla"
    with pytest.raises(ValueError, match="quant_impl 'tpu' is not one of"):
        quantized.quantizer("tpu")


def test_fp8_impls_names_what_each_grouped_matmul_runs(monkeypatch):
    """``nn.moe.fp8_impls`` (what step.py and profile records say "auto" ran as)."""
    from dropless.config.sections import MoEConfig
    from dropless.nn import moe
    from dropless.ops.gmm import mosaic

    cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=256,
                    gmm_quantization="te_fp8_blockwise")
    assert moe.fp8_impls(MoEConfig(num_experts=8, num_experts_per_tok=2, moe_mlp_dim=256), 512, 1024,
                         jnp.bfloat16) is None
    monkeypatch.setattr(mosaic, "is_available", lambda: True)
    assert moe.fp8_impls(cfg, 512, 1024, jnp.bfloat16) == {"wi": "kernel", "wo": "kernel"}
    assert moe.fp8_impls(cfg, 384, 1024, jnp.bfloat16) == {"wi": "emulate", "wo": "emulate"}
    # F = 384: fused gate|up is N = 768 (a kernel shape), unfused wi_0 and wi_1 are N = 384 each.
    odd = dataclasses.replace(cfg, moe_mlp_dim=384, gmm_quantization="te_fp8_blockwise")
    assert moe.fp8_impls(odd, 512, 1024, jnp.bfloat16)["wi"] == "kernel"
    assert moe.fp8_impls(dataclasses.replace(odd, prefuse_moe_weights=False), 512, 1024,
                         jnp.bfloat16)["wi"] == "emulate"
