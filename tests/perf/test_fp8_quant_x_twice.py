"""fp8_quant.py's ``x_quantized_twice``, the baseline its product rows time x's kept
codes against: the kernel path as it was (x quantized 1x128 in the forward, 128x1 again
in the backward) gives ``quantized.gmm``'s value, dx and dw bit for bit. The FP8 kernels
are their float32 references here, with XLA's quantizers (the GPU run checks the same
with the hardware's kernels and prints it as a ``check`` row)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops.gmm import quantized
from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]

# The baseline of a benchmark's comparison: run before a device call that times it.
pytestmark = pytest.mark.slow(reason="a benchmark baseline's CPU check, left out for CI time")


def test_x_quantized_twice_gives_the_kept_codes_bits(fp8_kernels_as_references):
    fq = load_module("fp8_quant", REPO / "benchmarks")
    rng = np.random.default_rng(7)
    gs = jnp.asarray([128, 0, 256], jnp.int32)
    x, w, dy = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                for s in ((384, 256), (3, 256, 256), (384, 256)))

    def fwd_bwd(f):
        y, vjp = jax.vjp(f, x, w)
        return [np.asarray(v).view(np.uint16) for v in (y, *vjp(dy))]

    kept = fwd_bwd(lambda x, w: quantized.gmm(x, w, gs, recipe="te_fp8_blockwise", impl="kernel",
                                              groups_aligned=True, quant_impl="xla"))
    twice = fwd_bwd(fq.x_quantized_twice(gs, quant_impl="xla"))
    for a, b in zip(kept, twice):
        np.testing.assert_array_equal(a, b)
    assert len(kept) == 3 and np.any(kept[2])
