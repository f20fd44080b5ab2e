"""tools/count_step_kernels.py: its two counts on CPU, and its reading of optimized HLO text."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

_PATH = Path(__file__).resolve().parents[2] / "tools" / "count_step_kernels.py"
_spec = importlib.util.spec_from_file_location("count_step_kernels", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

HLO = """HloModule jit_step, is_scheduled=true

%body.1 (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %a = bf16[64,64]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  %b = bf16[64,64]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%i, %b)
}

ENTRY %main.9 (x.1: bf16[64,64]) -> bf16[64,64] {
  %g = (f32[64,64]{1,0}, s8[1024]{0}) custom-call(%x.1, %x.1), custom_call_target="__cublas$lt$matmul"
  %c = bf16[64,64]{1,0} custom-call(%x.1), custom_call_target="mosaic_gpu_v2"
  %w = (s32[], bf16[64,64]{1,0}) while(%init), condition=%cond, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_compiled_counts_per_computation():
    """Mosaic custom-calls counted in the computation that holds them; cuBLAS calls are not."""
    assert tool._compiled_counts(HLO) == {"body.1": 2, "main.9": 1}
    assert tool._loop_trips(HLO) == {"body.1": 3}


def test_kernel_calls_multiply_by_the_scan_length():
    """A kernel call inside a scan of length 3 counts 3 executions; outside it, one. A
    ``pallas_call`` stands in for the Mosaic kernels (which need a GPU to trace for real)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    double = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                            interpret=True)

    def f(x):
        y = double(x)
        y, _ = jax.lax.scan(lambda c, _: (double(c), None), y, length=3)
        return y

    calls = tool._kernel_calls(jax.make_jaxpr(f)(jnp.ones((8, 128), jnp.float32)).jaxpr)
    assert sorted(m for _, m in calls) == [1, 3]
    assert sum(m for _, m in calls) == 4
