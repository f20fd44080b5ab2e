"""The FP8 blockwise grouped-matmul kernel sketch (``ops.gmm.mosaic_fp8``), on CPU only.

- It lowers for CUDA through ``jax.export`` (Mosaic's layout inference and
  smem checks run on the host).
- In Pallas GPU interpret mode it equals the float32 per-group product of
  the dequantized operands (boundary tiles, an empty group, a group smaller
  than a tile, a tail of rows past the total that must come out as zeros).
  The race detector is off: it reports the row-scale loads (see the open
  question in the module docstring).

Nothing here runs it on a GPU; it is not wired into any backend.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import mosaic_fp8


def test_lowers_for_cuda():
    m, k, n, g = 4096, 512, 768, 40
    s = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    args = (s((m, k), f8), s((k // 128, m), jnp.float32), s((g, n, k), f8),
            s((g, k // 128, n // 128), jnp.float32), s((g,), jnp.int32))
    fn = lambda *a: mosaic_fp8.gmm_fp8_blockwise(*a, sms=132)
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in exported.mlir_module()


def test_shape_checks():
    f8 = jnp.float8_e4m3fn
    s = jax.ShapeDtypeStruct
    good = dict(xq=s((64, 256), f8), sx=s((2, 64), jnp.float32), wq=s((2, 256, 256), f8),
                sw=s((2, 2, 2), jnp.float32), gs=s((2,), jnp.int32))
    mosaic_fp8.check_shapes(*good.values())
    for key, bad, match in [("xq", s((64, 256), jnp.bfloat16), "float8_e4m3fn"),
                            ("wq", s((2, 384, 256), f8), "n=384"),
                            ("sx", s((64, 2), jnp.float32), "sx must have shape"),
                            ("xq", s((60, 256), f8), "multiple of 8")]:
        args = dict(good, **{key: bad})
        if key == "xq" and bad.shape[0] == 60:
            args["sx"] = s((2, 60), jnp.float32)
        with pytest.raises(ValueError, match=match):
            mosaic_fp8.check_shapes(*args.values())


def test_interpret_matches_dequantized_product(rng):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k, n = 144, 256, 256  # two K steps (two scale blocks), one column band
    sizes = np.array([70, 0, 10, 30], np.int32)  # boundary tiles, a 10-row group, 34-row tail
    # Magnitudes vary per row, per K block and per N block: every scale differs.
    kb = np.repeat(np.exp(rng.uniform(-3, 3, (k // 128,))), 128)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-2, 2, (m, 1))) * kb
    w = (rng.standard_normal((len(sizes), k, n)) * np.exp(rng.uniform(-2, 2, (len(sizes), 1, n)))
         * np.repeat(np.exp(rng.uniform(-3, 3, (len(sizes), k // 128, 1))), 128, axis=1))
    ops = mosaic_fp8.quantize_operands(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    gs = jnp.asarray(sizes)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        y = mosaic_fp8.gmm_fp8_blockwise(*ops, gs, out_dtype=jnp.float32)
    ref = np.asarray(mosaic_fp8.reference(*ops, gs, out_dtype=jnp.float32), np.float64)
    y = np.asarray(y, np.float64)
    total = int(sizes.sum())
    np.testing.assert_array_equal(y[total:], 0.0)
    # Same products, accumulation in a different order: float32 rounding only.
    scale = np.abs(ref[:total]).max()
    np.testing.assert_allclose(y[:total], ref[:total], rtol=0, atol=1e-5 * scale)
