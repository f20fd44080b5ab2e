"""Shared by the Mosaic GPU quantizer tests (``test_fp8_quant_mgpu*.py``): interpret
mode with the race detector, and bitwise comparisons that treat NaN codes and NaN
scales exactly; and the FP8 kernel path's value and gradients by quantizer."""

import functools

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret():
    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True))


def races_found():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    return get_races().races_found


def bits(a):
    """a's bytes as unsigned integers: NaN codes and NaN scales compare bit for bit."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same_bits(got, want):
    assert len(got) == len(want)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype
        np.testing.assert_array_equal(bits(g_), bits(w_))


def same_codes_outside(got, want, mask):
    """Codes equal bit for bit where ``mask`` is false; ``got`` NaN where it is true (the
    elements of NaN-scale blocks, where compiled Triton writes -448 instead)."""
    np.testing.assert_array_equal(np.where(mask, 0, bits(got)), np.where(mask, 0, bits(want)))
    assert np.isnan(np.asarray(got).astype(np.float32)[mask]).all()


def kernel_path(x, w, dy, gs, aligned):
    """``run(quant_impl) -> (y, dx, dw)``: ``quantized.gmm(impl="kernel")``'s value and
    gradients at these operands with that quantizer, jitted (op by op, every op would
    compile), ``quant_impl`` static."""
    from dropless.ops.gmm import quantized

    @functools.partial(jax.jit, static_argnums=0)
    def run(quant_impl):
        f = lambda x, w: quantized.gmm(x, w, gs, recipe="te_fp8_blockwise", impl="kernel",  # noqa: E731
                                       groups_aligned=aligned, quant_impl=quant_impl)
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    return run
