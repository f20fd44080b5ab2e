"""``context`` kept means cuDNN attention's forward is not run again in the backward pass.

cuDNN's flash attention backward reads q, k, v, the attention output and the softmax
statistics (log-sum-exp). The attention output alone (``checkpoint_name(..., "context")``)
does not spare the forward: the statistics are a second output of jax's cuDNN forward
primitive, unnamed. ``remat_policy: minimal_with_context`` and ``remat_policy: custom`` with
``context: device | offload`` keep both outputs of that primitive (``remat.CUDNN_ATTENTION_FWD``),
as MaxText's Transformer Engine attention tags its output and statistics ``context``.

The policy's decisions are checked on CPU; the count of cuDNN forwards in the trainer's
gradient needs jax's CUDA plugin (marker ``gpu_compile``: the gradient is traced for an H200
under ``perf.gpu_compile.gpu_view``, no compile).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import ad_checkpoint

from dropless.perf import gpu_compile, jaxprs
from dropless.train import remat as remat_lib


class _Prim:
    """A stand-in primitive with a name: what a policy is asked about."""

    def __init__(self, name):
        self.name = name


def test_the_attention_primitive_name_is_jaxs():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    assert fa._dot_product_attention_fwd_p_wrapper.name == remat_lib.CUDNN_ATTENTION_FWD


@pytest.mark.parametrize("policy,custom,expected", [
    ("minimal", (), False),
    ("minimal_with_context", (), ad_checkpoint.Saveable),
    ("minimal_flash", (), ad_checkpoint.Saveable),
    ("custom", (("context", "device"),), ad_checkpoint.Saveable),
    ("custom", (("context", "offload"),), ad_checkpoint.Offloadable(src="device", dst="pinned_host")),
    ("custom", (("context", "remat"), ("mlpwo", "device")), ad_checkpoint.Recompute),
    ("full", (), False),
])
def test_what_each_policy_does_with_cudnn_attention(policy, custom, expected):
    decide = remat_lib.checkpoint_policy(policy, custom)
    assert decide(_Prim(remat_lib.CUDNN_ATTENTION_FWD)) == expected
    # Everything else is decided as before: an unnamed elementwise op is recomputed.
    assert decide(_Prim("sin")) in (False, ad_checkpoint.Recompute)


def test_minimal_with_context_is_minimal_and_attentions_inputs_and_output():
    """MaxText's ``minimal_with_context`` names: minimal's, q, k, v and the context."""
    from jax._src.ad_checkpoint import name_p

    minimal = remat_lib.checkpoint_policy("minimal")
    with_context = remat_lib.checkpoint_policy("minimal_with_context")
    added = ("query_proj", "key_proj", "value_proj", "context")
    for name in remat_lib.ACTIVATION_NAMES:
        assert bool(with_context(name_p, name=name)) == (bool(minimal(name_p, name=name)) or name in added)
    assert not any(minimal(name_p, name=name) for name in added)
    # MaxText's older name is the same policy.
    flash = remat_lib.checkpoint_policy("minimal_flash")
    for name in remat_lib.ACTIVATION_NAMES:
        assert flash(name_p, name=name) == with_context(name_p, name=name)


@pytest.mark.skipif(not gpu_compile.plugin_installed(), reason="needs jax's CUDA plugin (make gpu-compile-venv)")
@pytest.mark.gpu_compile
def test_trainer_gradient_runs_one_cudnn_forward_per_layer_with_the_context_kept():
    """deepseek3-tiny with cuDNN attention, layers unrolled, traced for an H200: two cuDNN
    forwards per layer under ``minimal`` (the forward and the backward's recomputation),
    one under ``minimal_with_context`` and ``custom`` keeping or offloading ``context``,
    as without remat; one cuDNN backward per layer in all."""
    from trainer_grad import loss_gradient, preset_model

    def counts(*keys):
        with gpu_compile.gpu_view(gpu_compile.devices()):
            m = preset_model("scan_layers=false", "dtype=bfloat16", "attention=cudnn_flash_te", *keys)
            grad, params, bias = loss_gradient(m, jnp.zeros((2, 64), jnp.int32), abstract=True)
            jaxpr = jax.make_jaxpr(grad)(params, bias).jaxpr
        c = jaxprs.primitive_counts(jaxpr)
        return m.num_decoder_layers, c[remat_lib.CUDNN_ATTENTION_FWD], c["dot_product_attention_bwd_wrapper"]

    layers, fwd, bwd = counts("remat_policy=minimal")
    assert layers > 1 and (fwd, bwd) == (2 * layers, layers)
    for keys in (["remat_policy=minimal_with_context"], ["remat_policy=custom", "context=device"],
                 ["remat_policy=custom", "context=offload"], ["remat_policy=none"]):
        assert counts(*keys) == (layers, layers, layers), keys
    assert counts("remat_policy=custom", "mlpwo=device") == (layers, 2 * layers, layers)
