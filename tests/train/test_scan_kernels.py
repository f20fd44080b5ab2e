"""The scanned train step hands XLA each expert kernel once, in a form XLA keeps once.

With the decoder layers in a scan and ``remat_policy=minimal``, the forward
loop stacks each forward grouped GEMM's output as a residual (a
``dynamic_update_slice``). When that output also fed the layer's next op, XLA's
GPU dynamic-slice fusion ran the kernel twice per layer, once into the residual
and once for the layer: 24 kernel launches per step for the proxy where the
jaxpr has 18 (``benchmarks/notes/scan.md``). The kernels lower for CUDA on a
CPU (``jax.export``), so the lowered step is checked here, before any XLA pass:
per while loop, the traced number of Mosaic calls, and no kernel result that is
both stacked and read by another op.
"""

import jax

from dropless.config import loader
from dropless.perf import stablehlo
from dropless.train import loop
from dropless.train import step as step_lib

# deepseek3-tiny with bf16 Mosaic kernels at dims they take unpadded (K and N
# multiples of 128; padded ones are sliced after the kernel, which hides the
# pattern): 1 dense layer, then 3 MoE layers in a scan.
OVERRIDES = ["dataset_type=synthetic", "model_name=deepseek3-tiny", "gmm_backend=mosaic",
             "dtype=bfloat16", "weight_dtype=bfloat16", "remat_policy=minimal", "scan_layers=true",
             "emb_dim=128", "moe_mlp_dim=128", "per_device_batch_size=2"]


def _lowered_step_kernels():
    cfg = loader.load_config(None, OVERRIDES, environ={}).config
    s = loop._setup(cfg.model(), cfg.train(), cfg.mesh())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s.abstract)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s.feed.local(0))
    step = step_lib.make_train_step(s.graphdef, s.model, s.tx, s.schedule)
    exported = jax.export.export(jax.jit(step), platforms=["cuda"])(state, batch)
    return stablehlo.kernel_calls(exported.mlir_module())


def _stacks(user: str) -> bool:
    return "dynamic_update" in user


def test_scanned_step_kernels_once_and_no_stacked_kernel_output_read_twice():
    calls = _lowered_step_kernels()
    by_loop = {}
    for call in calls:
        assert call.loops, f"a Mosaic kernel outside the layer scans: {call}"
        by_loop.setdefault(call.loops, []).append(call)
    # The forward loop (first in program order): gate/up and down GEMMs; the
    # backward loop: dgrad and wgrad of each. The jaxpr's 2 + 4 per MoE layer.
    assert [len(v) for v in by_loop.values()] == [2, 4], by_loop
    for call in calls:
        if any(_stacks(u) for u in call.users):
            assert len(call.users) == 1, (
                f"a kernel output stacked by the scan and read by {call.users}: XLA's "
                "dynamic-slice fusion duplicates such a kernel")
    forward = next(iter(by_loop.values()))
    assert all(c.users == ("stablehlo.optimization_barrier",) for c in forward), forward


def test_kernel_calls_follows_loops_calls_and_users():
    """``kernel_calls`` on a hand-made module: a kernel in a loop reached through a call."""
    text = """
    func.func private @body(%x: tensor<8xf32>) -> tensor<8xf32> {
      %y = stablehlo.custom_call @mosaic_gpu_v2(%x) : (tensor<8xf32>) -> tensor<8xf32>
      %z = stablehlo.add %y, %y : tensor<8xf32>
      %w = func.call @id(%y) : (tensor<8xf32>) -> tensor<8xf32>
      return %z : tensor<8xf32>
    }
    func.func private @id(%x: tensor<8xf32>) -> tensor<8xf32> {
      return %x : tensor<8xf32>
    }
    func.func public @main(%x: tensor<8xf32>) -> tensor<8xf32> {
      %a = stablehlo.custom_call @other(%x) : (tensor<8xf32>) -> tensor<8xf32>
      %b = stablehlo.custom_call @mosaic_gpu_v2(%a) : (tensor<8xf32>) -> tensor<8xf32>
      %c = stablehlo.constant dense<0> : tensor<i32>
      %r:2 = stablehlo.while(%i = %c, %v = %b) : tensor<i32>, tensor<8xf32>
        cond {
          %t = stablehlo.compare LT, %i, %c : (tensor<i32>, tensor<i32>) -> tensor<i1>
          stablehlo.return %t : tensor<i1>
        } do {
          %n = func.call @body(%v) : (tensor<8xf32>) -> tensor<8xf32>
          stablehlo.return %i, %n : tensor<i32>, tensor<8xf32>
        }
      return %r#1 : tensor<8xf32>
    }
    """
    assert stablehlo.kernel_calls(text) == [
        stablehlo.KernelCall((), ("stablehlo.while",)),
        stablehlo.KernelCall((0,), ("func.call @id", "stablehlo.add", "stablehlo.add")),
    ]
