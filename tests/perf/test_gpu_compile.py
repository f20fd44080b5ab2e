"""perf.gpu_compile: XLA:GPU's optimized HLO for an H200, compiled without a GPU.

Marker ``gpu_compile`` (``make test-gpu-compile``; skipped where jax's CUDA plugin
is not installed): what the H200 compiles for the FP8 dense products, at the
proxy's ``mla.wo`` shape (x [2, 4096, 16384] . w [16384, 7168], bf16):
- ``fp8_dot_bf16_output``: the forward, dgrad and wgrad are three
  ``__cublas$lt$matmul$f8`` calls writing bfloat16, each with its scale as an
  operand (not the constant 1), and no fusion reads their results (they are the
  outputs);
- the float32 form: the same three calls writing float32, each followed by a
  convert fusion (the 8 bytes per element ``fp8_dot_bf16_output`` saves).

And ``benchmarks/fp8_dense.py``'s HLO checks, run on the H200's program of its linear, and
the trainer's whole deepseek3-proxy FP8 step (``tools/compile_step_for_gpu.py``) with and
without ``fp8_dot_bf16_output``.

Without the plugin (CI): the command line refuses with exit code 2 and one line.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dropless.ops import fp8_dot, quant
from dropless.perf import gpu_compile
from dropless.perf import hlo
from dropless.perf.bench import load_module

REPO = Path(__file__).resolve().parents[2]

needs_plugin = pytest.mark.skipif(not gpu_compile.plugin_installed(),
                                  reason="needs jax's CUDA plugin (make gpu-compile-venv)")
DIMS = (((2,), (0,)), ((), ()))
ARGS = (jax.ShapeDtypeStruct((2, 4096, 16384), jnp.bfloat16),
        jax.ShapeDtypeStruct((16384, 7168), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, 4096, 7168), jnp.bfloat16))

def _linear_value_and_grads(bf16_output):
    def fn(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_dot.fp8_dot_general(x, w, DIMS, bf16_output=bf16_output),
                         x, w)
        return (y, *vjp(dy))

    return fn


def _entry(text):
    """The entry computation's instructions (``perf.hlo.instructions``)."""
    entry = hlo.entry_name(text)
    return [i for i in hlo.instructions(text) if i.computation == entry]


def _fp8_calls(text):
    """(name, result dtype, operand names) of each cuBLASLt FP8 GEMM call in the entry."""
    return [(i.name, i.result_types[0].split("[")[0], [name for _, name in i.operands])
            for i in _entry(text) if i.custom_call_target == "__cublas$lt$matmul$f8"]


def _readers(text, name):
    """Entry instructions (but bitcasts and the ROOT) that read the call ``name``'s result."""
    entry = _entry(text)
    results = {i.name for i in entry if i.opcode == "get-tuple-element"
               and i.operands[0][1] == name and "index=0" in i.attrs}
    return [f"{i.name} {i.opcode}{i.attrs}" for i in entry
            if i.opcode != "bitcast" and not i.root and results & {n for _, n in i.operands}]


@needs_plugin
@pytest.mark.gpu_compile
@pytest.mark.parametrize("bf16_output", [False, True])
def test_each_fp8_gemm_writes_bf16_itself_or_float32_then_a_convert(bf16_output):
    """The forward, dgrad and wgrad are three cuBLASLt FP8 calls. With ``bf16_output`` each
    writes bf16 with the product's scale as its operand (not the constant 1) and nothing
    reads its result in the entry; in the float32 form each writes float32 and one convert
    fusion reads it."""
    text = gpu_compile.compile_text(_linear_value_and_grads(bf16_output), *ARGS)
    calls = _fp8_calls(text)
    assert len(calls) == 3, text[-6000:]
    for name, dtype, operands in calls:
        readers = _readers(text, name)
        if bf16_output:
            assert dtype == "bf16", (name, dtype)
            assert "constant" not in operands[2], (name, operands)  # the product's scale
            assert readers == [], (name, readers)
        else:
            assert dtype == "f32", (name, dtype)
            assert len(readers) == 1 and "convert" in readers[0], (name, readers)


@needs_plugin
@pytest.mark.gpu_compile
@pytest.mark.parametrize("bf16_output", [False, True])
def test_fp8_dense_benchmark_checks_read_the_h200_program(bf16_output):
    """``benchmarks/fp8_dense.py``'s HLO checks on the H200's program of its own linear (the
    model's ``nnx.Linear``): 3 dots, all FP8, writing float32 or, with ``bf16_output``, bf16."""
    bench = load_module("fp8_dense", REPO / "benchmarks")
    _, fwd_bwd = bench.linear_fns(16384, 7168, bench.FP8, jnp.bfloat16, jnp.bfloat16, bf16_output)
    w, x, dy = ARGS[1], ARGS[0], ARGS[2]
    checks = bench.hlo_checks(gpu_compile.compile_text(fwd_bwd, w, x, dy))
    assert checks["f8e4m3"] and checks["f8e5m2"]
    assert checks["dots"] == checks["f8_dots"] == 3
    assert checks["f8_dot_out"] == {"bf16" if bf16_output else "f32": 3}


def test_command_line_errors_are_one_line_with_exit_2(tmp_path, capsys):
    prog = tmp_path / "prog.py"
    prog.write_text("X = 1\n")
    assert gpu_compile.main([str(tmp_path / "missing.py")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert gpu_compile.main([str(prog)]) == 2
    assert "must define FN" in capsys.readouterr().err
    if not gpu_compile.plugin_installed():
        prog.write_text("import jax, jax.numpy as jnp\nFN = lambda x: x\n"
                        "ARGS = (jax.ShapeDtypeStruct((2,), jnp.float32),)\n")
        assert gpu_compile.main([str(prog)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "make gpu-compile-venv" in err


PROXY_FP8 = ["model_name=deepseek3-proxy", "quantization=te_fp8_currentscaling",
             "te_gmm_quantization=te_fp8_blockwise"]


@needs_plugin
@pytest.mark.gpu_compile
@pytest.mark.parametrize("bf16_output", [False, True])
def test_proxy_fp8_step_on_the_h200(bf16_output):
    """The trainer's deepseek3-proxy FP8 step as the H200 compiles it
    (``tools/compile_step_for_gpu.py``, about a minute each): the 21 FP8 GEMMs of the dense
    products (``mla.wo`` x4 and the dense MLP's three, each fwd/dgrad/wgrad) write float32,
    7 of them into passes that only convert to bf16; with ``fp8_dot_bf16_output`` all 21
    write bf16 and no such pass is left. The grouped GEMMs run as the FP8 Mosaic GPU kernels
    (36 calls with their quantizers) and attention as cuDNN's fused calls in both: 8, a
    forward and a backward per layer (the preset's ``minimal_with_context`` keeps the
    forward's output and statistics; ``minimal`` ran each forward again, 12). With
    its layers unrolled the step has no while loop: the MoE layers' group lookups are
    written out (a loop's iterations are kernels of their own, each a launch). The loss's
    backward writes the logits' gradient in bf16 from the bf16 logits, with no float32 copy."""
    tool = load_module("compile_step_for_gpu", REPO / "tools")
    text, _ = tool.compile_step([*PROXY_FP8, f"fp8_dot_bf16_output={str(bf16_output).lower()}"])
    counts = tool.summarize(text)
    assert counts["fp8_gemm_calls"] == 21
    if bf16_output:
        assert counts["fp8_gemm_output_dtypes"] == {"bf16": 21}
        assert counts["convert_only_fusions"] == {}
    else:
        assert counts["fp8_gemm_output_dtypes"] == {"f32": 21}
        assert counts["convert_only_fusions"] == {"after an FP8 GEMM": 7}
    assert counts["mosaic_gpu_calls"] == 36 and counts["cudnn_calls"] == 8
    assert counts["while_loops"] == 0
    # The loss reads the head's bf16 logits and its backward writes their gradient in bf16
    # in one pass (ops.cross_entropy): no kernel writes a float32 [B, S, V] array (three
    # did, 4 GiB each, before).
    written = [t for i in hlo.launches(list(hlo.instructions(text))) for t in i.result_types]
    assert not [t for t in written if t.startswith(("f32[2,4096,129280]", "f32[8192,129280]"))]
    assert [t for t in written if t.startswith(("bf16[2,4096,129280]", "bf16[8192,129280]"))]


@needs_plugin
@pytest.mark.gpu_compile
@pytest.mark.parametrize("recipe", ["te_fp8_blockwise", "te_mxfp8"])
def test_emulated_grouped_gemm_recipes_keep_their_fp8_codes_on_the_h200(recipe):
    """The emulated recipes (quantize, dequantize, the bf16 kernel) under ``jit`` on the
    H200: XLA:GPU folds an f32 -> f8 -> f32 round trip into the identity, which once made
    the emulation plain bf16 while the log said FP8 (``quant.keep_codes`` prevents it).
    The compiled value and gradient hold E4M3 codes and run on the bf16 Mosaic GPU kernel;
    with ``keep_codes`` made the identity the codes are gone (the fold this guards against)."""
    from dropless.ops.gmm import quantized

    sizes = jnp.asarray([512, 0, 1024, 512], jnp.int32)

    def fn(x, w):
        def loss(x, w):
            y = quantized.gmm(x, w, sizes, recipe=recipe, impl="emulate", out_dtype=jnp.float32)
            return jnp.sum(y * y)

        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    args = (jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 1024, 512), jnp.bfloat16))
    text = gpu_compile.compile_text(fn, *args)
    assert "f8e4m3fn[" in text
    assert "mosaic_gpu" in text
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant, "keep_codes", lambda q, scales: (q, scales))
        # A new function object: jit's trace cache would hand back the first trace.
        assert "f8e4m3fn[" not in gpu_compile.compile_text(lambda x, w: fn(x, w), *args)


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("bf16_output", [False, True])
def test_hlo_readers_on_a_recorded_h200_program(bf16_output):
    """Everywhere (CI too): ``tools/compile_step_for_gpu.summarize`` and ``fp8_dense.py``'s
    checks on the H200 programs of one FP8 linear's value and gradients, compiled by
    ``perf.gpu_compile`` at 07cf80e and kept as fixtures (``fixtures/h200_fp8_linear_*``):
    three FP8 GEMM calls, writing float32 into three convert-only passes, or bf16 with
    none."""
    import gzip

    name = "bf16" if bf16_output else "f32"
    text = gzip.open(FIXTURES / f"h200_fp8_linear_{name}_out.hlo.txt.gz", "rt").read()
    counts = load_module("compile_step_for_gpu", REPO / "tools").summarize(text)
    assert counts["fp8_gemm_calls"] == 3
    assert counts["fp8_gemm_output_dtypes"] == {name: 3}
    assert counts["convert_only_fusions"] == ({} if bf16_output else {"after an FP8 GEMM": 3})
    checks = load_module("fp8_dense", REPO / "benchmarks").hlo_checks(text)
    assert checks["dots"] == checks["f8_dots"] == 3 and checks["f8_dot_out"] == {name: 3}
