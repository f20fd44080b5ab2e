"""fp8_dense.hlo_checks: dots/GEMMs and their FP8 operands in optimized HLO text.

XLA's GPU HLO prints a custom-call's operands by name only, so their types must be
read from the defining instructions; other printers put the type inline.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]

# The H200's form (shapes of mla.wq_a): quantize fusions, cuBLASLt FP8 GEMMs fed by name,
# a bf16 cuBLAS GEMM, a Triton GEMM fusion whose dot is bf16, and a custom-call that is no
# GEMM though its backend_config says "gemm" and "matmul".
GPU_HLO = r"""HloModule jit_fwd_bwd, is_scheduled=true, entry_computation_layout={(bf16[7168,1536]{1,0})->bf16[8192,1536]{1,0}}

%fused_quantize (param_0.4: bf16[8192,7168], param_1.2: f32[]) -> f8e4m3fn[8192,7168] {
  %param_0.4 = bf16[8192,7168]{1,0} parameter(0)
  %param_1.2 = f32[] parameter(1)
  ROOT %convert.9 = f8e4m3fn[8192,7168]{1,0} convert(%param_0.4)
}

%triton_gemm_computation (param_0: bf16[64,7168], param_1: bf16[7168,1536]) -> bf16[64,1536] {
  %param_0 = bf16[64,7168]{1,0} parameter(0)
  %param_1 = bf16[7168,1536]{1,0} parameter(1)
  ROOT %dot.4 = bf16[64,1536]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.2 (x.1: bf16[8192,7168], w.1: f8e4m3fn[1536,7168], g.1: f8e5m2[8192,1536], param.2: f32[], param.3: f32[], param.4: f32[]) -> (bf16[8192,1536], bf16[8192,7168], bf16[64,1536]) {
  %x.1 = bf16[8192,7168]{1,0} parameter(0)
  %w.1 = f8e4m3fn[1536,7168]{1,0} parameter(1)
  %g.1 = f8e5m2[8192,1536]{1,0} parameter(2)
  %param.2 = f32[] parameter(3)
  %param.3 = f32[] parameter(4)
  %param.4 = f32[] parameter(5)
  %fusion.3 = f8e4m3fn[8192,7168]{1,0} fusion(%x.1, %param.2), kind=kLoop, calls=%fused_quantize
  %bitcast.7 = f8e4m3fn[1536,7168]{1,0} bitcast(%w.1)
  %cublas-gemm.1 = (bf16[8192,1536]{1,0}, s8[4194304]{0}) custom-call(%fusion.3, %bitcast.7, %param.2, %param.3), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"epilogue":"DEFAULT"}}
  %get-tuple-element.1 = bf16[8192,1536]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %bitcast.8 = f8e4m3fn[7168,1536]{1,0} bitcast(%w.1)
  %cublas-gemm.3 = (bf16[8192,7168]{1,0}, s8[4194304]{0}) custom-call(%g.1, %bitcast.8, %param.2, %param.3, /*index=4*/%param.4), custom_call_target="__cublas$lt$matmul$fp8"
  %get-tuple-element.3 = bf16[8192,7168]{1,0} get-tuple-element(%cublas-gemm.3), index=0
  %amax.1 = f32[] custom-call(%fusion.3), custom_call_target="__cudnn$amax", backend_config={"note":"before the gemm / matmul"}
  %slice.1 = bf16[64,7168]{1,0} slice(%x.1), slice={[0:64], [0:7168]}
  %bitcast.9 = bf16[7168,1536]{1,0} bitcast(%get-tuple-element.1)
  %cublas-gemm.5 = (bf16[64,1536]{1,0}, s8[1048576]{0}) custom-call(%slice.1, %bitcast.9), custom_call_target="__cublas$gemm"
  %gemm_fusion.2 = bf16[64,1536]{1,0} fusion(%slice.1, %bitcast.9), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %tuple.1 = (bf16[8192,1536]{1,0}, bf16[8192,7168]{1,0}, bf16[64,1536]{1,0}, /*index=3*/bf16[64,1536]{1,0}) tuple(%get-tuple-element.1, %get-tuple-element.3, %get-tuple-element.1, /*index=3*/%gemm_fusion.2)
}
"""


@pytest.fixture(scope="module")
def bench():
    return load_module("fp8_dense", REPO / "benchmarks")


def test_gpu_gemms_fed_by_name_resolve_their_operand_types(bench):
    """4 dots: the two cuBLASLt FP8 GEMMs (E4M3 x E4M3, E5M2 x E4M3, operands by name), the
    bf16 cuBLAS GEMM and the Triton fusion's bf16 dot; not the amax custom-call. The parser
    before version 2 found 0 FP8 dots and 5 dots here (it read "gemm" in a backend_config)."""
    got = bench.hlo_checks(GPU_HLO)
    assert (got["dots"], got["f8_dots"]) == (4, 2)
    assert got == {"f8e4m3": True, "f8e5m2": True, "dots": 4, "f8_dots": 2,
                   "f8_dot_out": {"bf16": 2}, "hlo_check": 2}


def test_inline_operand_types(bench):
    """Other printers put types inline; a tuple result and a non-GEMM custom-call, too."""
    hlo = "\n".join([
        '  %custom-call.1 = (f32[8,16]{1,0}, s8[64]{0}) custom-call(f8e4m3fn[8,32]{1,0} %x, '
        'f8e5m2[16,32]{1,0} %w, f32[] %a), custom_call_target="__cublas$lt$matmul$f8"',
        "  ROOT %dot.3 = bf16[8,16]{1,0} dot(bf16[8,32]{1,0} %p0, bf16[32,16]{1,0} %p1), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        '  %cc = (bf16[8,16]{1,0}, s8[64]{0}) custom-call(bf16[8,32]{1,0} %x, bf16[32,16]{1,0} '
        '%w), custom_call_target="__cublas$gemm"',
        '  %r = f32[] custom-call(f32[] %x), custom_call_target="amax"',
        "  %d = f32[8,16]{1,0} dot(f8e4m3fn[8,32]{1,0} %x, /*index=1*/bf16[32,16]{1,0} %w)",
    ])
    got = bench.hlo_checks(hlo)
    assert (got["dots"], got["f8_dots"]) == (4, 1)
    assert got["f8_dot_out"] == {"f32": 1}  # the tuple result's first element


def test_names_resolve_within_their_computation(bench):
    """%p is FP8 in one computation and bf16 in the next: the dot in the second is not FP8;
    one FP8 and one bf16 matrix operand is not an FP8 dot either."""
    hlo = "\n".join([
        "%a (p: f8e4m3fn[8,32]) -> f8e4m3fn[8,32] {",
        "  ROOT %p = f8e4m3fn[8,32]{1,0} parameter(0)",
        "}",
        "%b (p: bf16[8,32], q: bf16[32,16]) -> f32[8,16] {",
        "  %p = bf16[8,32]{1,0} parameter(0)",
        "  %q = bf16[32,16]{1,0} parameter(1)",
        "  ROOT %dot = f32[8,16]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
        "ENTRY %main (x: f8e4m3fn[8,32], y: f8e4m3fn[32,16], z: bf16[32,16]) -> f32[8,16] {",
        "  %x = f8e4m3fn[8,32]{1,0} parameter(0)",
        "  %y = f8e4m3fn[32,16]{1,0} parameter(1)",
        "  %z = bf16[32,16]{1,0} parameter(2)",
        "  %dot.1 = f32[8,16]{1,0} dot(%x, %z), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "  ROOT %dot.2 = f32[8,16]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
    ])
    got = bench.hlo_checks(hlo)
    assert (got["dots"], got["f8_dots"]) == (3, 1)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_real_cpu_hlo(bench, dtype):
    """XLA:CPU's optimized HLO of one dot: one dot, never with FP8 operands, because XLA:CPU
    converts FP8 codes to f32 before its dot (read from the text here, independently of the
    parser: the dot's operands are defined as f32 / bf16 in its computation)."""
    a, b = jnp.ones((8, 32), dtype), jnp.ones((32, 16), dtype)
    hlo = jax.jit(_dot).lower(a, b).compile().as_text()
    if jax.default_backend() != "cpu":
        pytest.skip("the expected counts are XLA:CPU's")
    (line,) = [ln for ln in hlo.splitlines() if " dot(" in ln]
    names = re.search(r" dot\((%\S+), (%\S+)\)", line).groups()
    want = "f32[" if dtype == jnp.float8_e4m3fn else "bf16["
    for name in names:
        assert re.search(rf"^\s*{re.escape(name)} = {re.escape(want)}", hlo, re.M), (name, hlo)
    assert ("f8e4m3fn" in hlo) == (dtype == jnp.float8_e4m3fn)
    got = bench.hlo_checks(hlo)
    assert got == {"f8e4m3": dtype == jnp.float8_e4m3fn, "f8e5m2": False, "dots": 1,
                   "f8_dots": 0, "f8_dot_out": {}, "hlo_check": 2}
