"""``remat_policy=minimal`` keeps the expert kernels' outputs: no recomputed expert forward.

The grouped GEMMs are Mosaic GPU kernels (``mpmd_map`` in the jaxpr), which
``checkpoint_dots_with_no_batch_dims`` cannot see. Tracing needs no GPU: the
kernels are counted in the jaxpr of the gradient, before any compiler runs.
"""

from collections import Counter

import jax
import jax.numpy as jnp

from dropless.nn.moe import grouped_swiglu
from dropless.perf import jaxprs
from dropless.train import remat as remat_lib


def _kernels_in_grad(policy):
    p, d, f, g = 256, 128, 128, 2
    x = jnp.ones((p, d), jnp.bfloat16)
    sizes = jnp.full((g,), p // g, jnp.int32)
    wi, wo = jnp.ones((g, d, 2 * f), jnp.bfloat16), jnp.ones((g, f, d), jnp.bfloat16)

    def layer(x, wi, wo):
        return grouped_swiglu(jnp.sin(x), sizes, (wi, wo), backend="mosaic").astype(jnp.float32).sum()

    fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(x, wi, wo).jaxpr
    return jaxprs.primitive_counts(jaxpr)["mpmd_map"]


def test_minimal_runs_each_expert_kernel_once():
    """2 forward GEMMs + 2 dgrad + 2 wgrad, as without remat; the dots-only policy
    traces a recomputed forward GEMM (7), which is what the names prevent."""
    assert _kernels_in_grad(None) == 6
    assert _kernels_in_grad(remat_lib.checkpoint_policy("minimal")) == 6
    assert _kernels_in_grad(jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims) == 7
    assert _kernels_in_grad(remat_lib.checkpoint_policy("full")) == 7


def test_unrolled_layers_keep_what_the_scan_keeps():
    """With scan_layers=false each layer slices its parameters inside the
    rematerialised function: the backward pass keeps the same residuals as the
    scan (it used to keep every layer's weight slices too), and the gradients
    are the scan's."""
    import dataclasses

    import numpy as np
    from trainer_grad import loss_gradient, preset_model

    from dropless.perf import memory

    cfg = preset_model("remat_policy=minimal")
    unrolled = dataclasses.replace(cfg, scan_layers=False)

    def kept(m):
        return sum(memory._nbytes(aval) for aval, _ in memory._residuals(m, 2, 16))

    assert kept(unrolled) == kept(cfg)
    grads = []
    for m in (cfg, unrolled):
        tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, m.vocab_size)
        grad, params, bias = loss_gradient(m, tokens)
        # Jitted: one compile each, where op by op the backward pass dispatched (and
        # compiled) its primitives one at a time.
        grads.append(jax.jit(grad)(params, bias))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_minimal_keeps_the_fp8_dense_codes():
    """An FP8 dense product under ``minimal`` quantizes each forward operand once: the
    backward reads the kept codes and quantizes only the incoming gradient (3 amax
    reductions in the gradient's jaxpr). Without the name, the backward pass recomputes
    the layer's input and quantizes both operands again (5)."""
    from dropless.ops import fp8_dot

    x = jnp.ones((64, 128), jnp.bfloat16)
    w = jnp.ones((128, 256), jnp.bfloat16)

    def layer(x, w):
        y = fp8_dot.fp8_dot_general(jnp.sin(x), w, (((1,), (0,)), ((), ())))
        return y.astype(jnp.float32).sum()

    def amaxes(policy):
        fn = jax.checkpoint(layer, policy=policy)
        jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(x, w).jaxpr
        return jaxprs.primitive_counts(jaxpr)["reduce_max"]

    assert amaxes(remat_lib.checkpoint_policy("minimal")) == 3
    assert amaxes(jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims) == 5
    # remat_policy=custom keeps them when its config key says so, and only then.
    assert amaxes(remat_lib.checkpoint_policy("custom", (("fp8_dot_codes", "device"),))) == 3
    assert amaxes(remat_lib.checkpoint_policy("custom", (("fp8_dot_codes", "remat"),))) == 5


def _reduce_max_scopes(jaxpr):
    """Counter of the name stacks of ``reduce_max`` equations in ``jaxpr`` and its sub-jaxprs."""
    return Counter(str(eqn.source_info.name_stack) for eqn in jaxprs.equations(jaxpr)
                   if eqn.primitive.name == "reduce_max")


def test_minimal_keeps_the_fp8_dense_codes_when_the_output_is_recomputed():
    """A product whose output a consumer's gradient needs (tanh here; SwiGLU, a norm or
    the residual stream in a layer): the backward pass recomputes that output from the
    kept GEMM output and the kept scales, and quantizes nothing of the forward again.
    When the forward product read the scales before they were named, the recomputed
    output depended on unnamed scales and both operands were quantized again in the
    backward pass (5 amaxes, 2 of them under ``rematted_computation``)."""
    from dropless.ops import fp8_dot

    x = jnp.ones((64, 128), jnp.bfloat16)
    w = jnp.ones((128, 256), jnp.bfloat16)

    def layer(x, w):
        y = fp8_dot.fp8_dot_general(jnp.sin(x), w, (((1,), (0,)), ((), ())))
        return jnp.tanh(y).astype(jnp.float32).sum()

    for policy in (remat_lib.checkpoint_policy("minimal"),
                   remat_lib.checkpoint_policy("custom", (("fp8_dot_codes", "device"),))):
        fn = jax.checkpoint(layer, policy=policy)
        scopes = _reduce_max_scopes(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(x, w).jaxpr)
        assert sum(scopes.values()) == 3, scopes
        assert not [s for s in scopes if "rematted" in s], scopes
    # Without the codes kept, the backward pass does quantize the recomputed operands again.
    fn = jax.checkpoint(layer, policy=remat_lib.checkpoint_policy("custom", (("fp8_dot_codes", "remat"),)))
    scopes = _reduce_max_scopes(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(x, w).jaxpr)
    assert sum(n for s, n in scopes.items() if "rematted" in s) == 2, scopes


def test_trainer_step_under_minimal_quantizes_no_dense_operand_twice():
    """The trainer's gradient (deepseek3-tiny, every dense product in FP8, layers
    unrolled, ``remat_policy: minimal``): no FP8 quantization runs under the backward
    pass's recomputation, and the gradient has exactly the amaxes of the same model
    without remat (each forward operand once, each incoming gradient once)."""
    from trainer_grad import loss_gradient, preset_model

    def scopes(remat_policy):
        grad, params, bias = loss_gradient(preset_model(
            f"remat_policy={remat_policy}", "scan_layers=false", "quantization=te_fp8_currentscaling",
            "fp8_min_dim=0"))
        counts = _reduce_max_scopes(jax.make_jaxpr(grad)(params, bias).jaxpr)
        return Counter({s: n for s, n in counts.items() if "fp8_quantize" in s})

    minimal, none = scopes("minimal"), scopes("none")
    assert not [s for s in minimal if "rematted" in s], minimal
    assert sum(none.values()) > 0
    assert sum(minimal.values()) == sum(none.values()), (minimal, none)


def test_minimal_keeps_the_fp8_expert_inputs_codes(monkeypatch):
    """The FP8 expert kernels under ``minimal``: each GEMM's forward quantizes its input
    into both layouts in one kernel (1x128 for itself, 128x1 for wgrad), and the kept
    128x1 codes (``moe_fp8_input_codes``) are what wgrad reads. Per GEMM: the weight's
    both-layouts pass, x's rows-and-columns pass and the forward kernel; in the backward
    dy's rows-and-columns pass, dgrad and wgrad: 6 Mosaic GPU kernels, 12 for the layer,
    and the layer input's ``sin`` runs once. Without the name the backward pass
    recomputes the input (a second ``sin``, a second SwiGLU) and quantizes both inputs
    again (14 kernels); without remat it keeps the codes too (12)."""
    from dropless.ops.gmm import mosaic

    monkeypatch.setattr(mosaic, "is_available", lambda: True)
    p, d, f, g = 256, 256, 256, 2
    x = jnp.ones((p, d), jnp.bfloat16)
    sizes = jnp.full((g,), p // g, jnp.int32)
    wi, wo = jnp.ones((g, d, 2 * f), jnp.bfloat16), jnp.ones((g, f, d), jnp.bfloat16)

    def layer(x, wi, wo):
        y = grouped_swiglu(jnp.sin(x), sizes, (wi, wo), backend="mosaic",
                           quantization="te_fp8_blockwise", fp8_impl="kernel",
                           fp8_quantizer="mosaic")
        return y.astype(jnp.float32).sum()

    def counts(policy):
        fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
        jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(x, wi, wo).jaxpr
        c = jaxprs.primitive_counts(jaxpr)
        return c["mpmd_map"], c["sin"]

    without_input_codes = jax.checkpoint_policies.save_only_these_names(
        "moe_mlpwi", "moe_mlpwo", "moe_fp8_weights")
    assert counts(None) == (12, 1)
    assert counts(remat_lib.checkpoint_policy("minimal")) == (12, 1)
    assert counts(without_input_codes) == (14, 2)
    # remat_policy=custom with the config keys of the codes: as minimal; without them
    # (a MaxText recipe's custom policy) the backward pass quantizes everything again.
    # Each weight's both-layouts pass runs again without moe_fp8_weights (16).
    outputs = (("moe_mlpwi", "device"), ("moe_mlpwo", "device"))
    weights = (("moe_fp8_weights", "device"),)
    inputs = (("moe_fp8_input_codes", "device"),)
    assert counts(remat_lib.checkpoint_policy("custom", outputs + weights + inputs)) == (12, 1)
    assert counts(remat_lib.checkpoint_policy("custom", outputs + weights)) == (14, 2)
    assert counts(remat_lib.checkpoint_policy("custom", outputs)) == (16, 2)
