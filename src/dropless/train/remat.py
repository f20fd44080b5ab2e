"""Rematerialisation and host-offload policies for one decoder layer.

The backward pass needs the forward activations of every layer. A policy
decides, per named activation (``checkpoint_name`` tags in ``nn``), whether it
is kept in device memory, copied to pinned host memory (and back for the
backward pass), or recomputed from the layer input.

``remat_policy`` (MaxText's names):

* ``none``: no checkpointing; XLA keeps whatever it needs (most memory).
* ``full``: keep nothing but the layer input; recompute the whole layer.
* ``minimal``: keep every matmul output without batch dimensions
  (``checkpoint_dots_with_no_batch_dims``): weights-times-activations, not
  attention scores. The experts' grouped matmuls are kernels (or
  ``ragged_dot``), not ``dot_general``, which that policy cannot see, so their
  outputs (``moe_mlpwi``, ``moe_mlpwo``), the FP8 kernels' weight codes
  (``moe_fp8_weights``, one byte per weight), their inputs' 128x1 codes for wgrad
  (``moe_fp8_input_codes``, one byte per element: the backward pass then neither
  recomputes the dispatched tokens or SwiGLU's output nor quantizes them) and the
  FP8 dense products' codes
  and scales (``fp8_dot_codes``: their backward's operands, so the backward
  pass neither recomputes a product's inputs nor quantizes them again) are
  kept by name as well. Without
  them the traced backward pass recomputes the gate/up GEMM of each layer
  (``tests/train/test_remat_kernels.py``) and the FP8 weight quantization. On
  the H200 the FP8 proxy step then quantizes each expert weight once instead
  of twice and spends 49.7 instead of 53.3 ms per step quantizing
  (profile-20261202-001355 against -005357), for about 4 GiB more saved
  activations. Its grouped-GEMM kernel time did not change (80.4 ms, 24
  launches per step in both profiles, layers in a scan). With the layers
  unrolled (the proxy preset's default) the compiled bf16 step has exactly the
  traced 18 kernel launches, 6 forward (``jvp``) and 12 backward
  (``transpose``), none recomputed (``tools/count_step_kernels.py``,
  ``benchmarks/results/logs/count-step-kernels-unrolled-20261202-0527-h200.log``);
  the scan's 6 more were XLA's dynamic-slice fusion running each forward GEMM
  a second time to write the stacked residual in place, not this policy's
  (``nn.moe.grouped_swiglu`` now gives it nothing to duplicate;
  ``benchmarks/notes/scan.md``).
* ``minimal_with_context`` (MaxText's name; ``minimal_flash``, its older one, is
  the same): ``minimal``, and attention's inputs and output kept too: q, k and v as
  attention reads them (``query_proj``, ``key_proj``, ``value_proj``: MLA's after
  the rope and the concatenations) and its output (``context``), as MaxText's
  ``minimal_with_context`` names them. With cuDNN attention ``context`` also covers
  the softmax statistics (log-sum-exp) that cuDNN's backward reads, as MaxText's
  Transformer Engine attention tags them: jax's cuDNN forward
  (``CUDNN_ATTENTION_FWD``) keeps both its outputs, so the backward pass runs no
  attention forward again, nor rebuilds q, k and v. Under ``minimal`` it does both:
  the proxy's bf16 step compiled for an H200 has three cuDNN calls per layer there
  (forward, the forward again, backward) and two here, and about 10 GB less
  traffic in the recomputation besides the forwards, for 1.5 GiB more at XLA's
  peak (61.63 against 60.12 GiB).
* ``save_dot_except_mlp``: keep the attention projections (query/key/value,
  the MLA latents, the output projection); recompute the MLP/expert matmuls.
* ``custom``: per-tensor choice from ``remat_custom``, pairs ``(name, action)``
  with action ``remat`` | ``device`` | ``offload``; names not listed are
  recomputed (``context`` kept or offloaded covers cuDNN's statistics as under
  ``minimal_with_context``). The config keys are MaxText's names plus the FP8 codes above
  (``moe_fp8_weights``, ``moe_fp8_input_codes``, ``fp8_dot_codes``), which
  MaxText's custom recipes cannot list: ``fp8_codes_recomputed_line`` names the
  ones a run makes and does not keep, at start and in ``--dry-run``. Built on
  ``save_and_offload_only_these_names`` with ``offload_dst="pinned_host"``.
"""

import dataclasses
from typing import Callable

import jax
from jax import ad_checkpoint

from dropless.config.sections import ModelConfig

REMAT_POLICIES = ("none", "full", "minimal", "minimal_with_context", "minimal_flash",
                  "save_dot_except_mlp", "custom")
CUSTOM_ACTIONS = ("remat", "device", "offload")

# The primitive of jax's cuDNN flash attention forward under a gradient
# (jax._src.cudnn.fused_attention_stablehlo; both ``jax.nn.dot_product_attention``
# and the unpadded-v path reach it). Its outputs are the attention output and the
# softmax statistics, which cuDNN's backward reads with q, k and v.
CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"

# Every checkpoint_name tagged in dropless.nn, plus MaxText's names for fused
# tensors this model does not have ("mlpwi", "qkv_proj"), accepted so MaxText
# recipes load but never matched. Anything else is a typo that would silently
# recompute, so it is rejected.
ACTIVATION_NAMES = (
    "decoder_layer_input",
    "mla_q",
    "mla_kv",
    "query_proj",
    "key_proj",
    "value_proj",
    "context",
    "out_proj",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "moe_mlpwi",
    "moe_mlpwo",
    "moe_fp8_weights",
    "moe_fp8_input_codes",
    "fp8_dot_codes",
    "mlpwi",
    "qkv_proj",
)

# What ``minimal`` keeps beyond the dots: the outputs of the expert matmuls,
# which run as kernels, the FP8 weight codes and input codes (128x1, for wgrad) those
# kernels' backward reads, and the
# FP8 dense products' codes and scales (``ops.fp8_dot``), their backward's operands.
_KERNEL_MATMUL_NAMES = ("moe_mlpwi", "moe_mlpwo", "moe_fp8_weights", "moe_fp8_input_codes",
                        "fp8_dot_codes")
_ATTENTION_NAMES = ("mla_q", "mla_kv", "query_proj", "key_proj", "value_proj", "out_proj")
# What ``minimal_with_context`` keeps beyond ``minimal``: attention's inputs as it reads
# them and its output (with cuDNN, the softmax statistics too: ``_KeepingAttention``).
_CONTEXT_NAMES = ("query_proj", "key_proj", "value_proj", "context")


@dataclasses.dataclass(frozen=True)
class _KeepingAttention:
    """``policy``, with jax's cuDNN attention forward's outputs (``CUDNN_ATTENTION_FWD``)
    kept on the device (``offload`` false) or copied to pinned host memory: what
    keeping ``context`` means where cuDNN computes attention."""

    policy: Callable
    offload: bool = False

    def __call__(self, prim, *avals, **params):
        if prim.name == CUDNN_ATTENTION_FWD:
            if self.offload:
                return ad_checkpoint.Offloadable(src="device", dst="pinned_host")
            return ad_checkpoint.Saveable
        return self.policy(prim, *avals, **params)


def custom_policy(remat_custom) -> Callable:
    """The checkpoint policy of ``remat_custom`` (pairs ``(name, action)``).

    Raises:
      ValueError: unknown name or action, or a name listed twice.
    """
    saved, offloaded, seen = [], [], set()
    for name, action in remat_custom:
        if name not in ACTIVATION_NAMES:
            raise ValueError(f"remat_custom: unknown tensor {name!r}; known: {ACTIVATION_NAMES}")
        if action not in CUSTOM_ACTIONS:
            raise ValueError(f"remat_custom: {name}={action!r} is not one of {CUSTOM_ACTIONS}")
        if name in seen:
            raise ValueError(f"remat_custom: {name!r} is listed twice")
        seen.add(name)
        if action == "device":
            saved.append(name)
        elif action == "offload":
            offloaded.append(name)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )
    if "context" in saved or "context" in offloaded:
        return _KeepingAttention(policy, offload="context" in offloaded)
    return policy


def fp8_codes_recomputed_line(cfg: ModelConfig, weight_codes_given: bool = False) -> str | None:
    """Under ``remat_policy=custom``, one line naming the FP8 codes this model makes
    that ``remat_custom`` does not mention (the backward pass then quantizes those
    operands again, and recomputes what they were made from) and the keys that keep
    them; None otherwise. A name set to ``remat`` is the user's choice and not named.
    MaxText's custom policies predate these names, so a recipe carried over
    verbatim (the MaxText DeepSeek-V3 recipe's ``remat_policy: custom`` with FP8)
    would pay this silently.
    ``weight_codes_given``: the trainer quantizes the expert weights once per step
    (``gmm_fp8_weights_once_per_step`` at work), so the kernels read those codes and
    ``moe_fp8_weights`` names nothing to recompute."""
    if cfg.remat_policy != "custom":
        return None
    from dropless.nn.model import has_fp8_dense_matmuls

    listed = {name for name, _ in cfg.remat_custom}
    moe = cfg.moe
    made = ("moe_fp8_input_codes",) if weight_codes_given else (
        "moe_fp8_weights", "moe_fp8_input_codes")
    kernels = [n for n in made if n not in listed] \
        if moe.gmm_quantization == "te_fp8_blockwise" and moe.gmm_fp8_impl != "emulate" else []
    dense = ["fp8_dot_codes"] if "fp8_dot_codes" not in listed and has_fp8_dense_matmuls(cfg) else []
    if not kernels and not dense:
        return None
    parts = []
    if kernels:
        parts.append(f"{', '.join(kernels)} (where the FP8 expert kernels run)")
    if dense:
        parts.append("fp8_dot_codes (the FP8 dense products)")
    keys = " ".join(f"{n}=device" for n in kernels + dense)
    return (f"remat_policy=custom does not keep {'; '.join(parts)}: the backward pass "
            f"quantizes those operands again; {keys} keeps them (remat_policy=minimal does)")


def checkpoint_policy(remat_policy: str, remat_custom=()) -> Callable | None:
    """The ``jax.checkpoint`` policy for ``remat_policy``; None means save nothing.

    Raises:
      ValueError: unknown policy (or bad ``remat_custom``), or ``none``, which
        has no policy because it is not checkpointed at all.
    """
    if remat_policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    if remat_policy == "minimal":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            jax.checkpoint_policies.save_only_these_names(*_KERNEL_MATMUL_NAMES))
    if remat_policy in ("minimal_with_context", "minimal_flash"):
        return _KeepingAttention(jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            jax.checkpoint_policies.save_only_these_names(*_KERNEL_MATMUL_NAMES, *_CONTEXT_NAMES)))
    if remat_policy == "save_dot_except_mlp":
        return jax.checkpoint_policies.save_only_these_names(*_ATTENTION_NAMES)
    if remat_policy == "custom":
        return custom_policy(remat_custom)
    raise ValueError(f"remat_policy={remat_policy!r} has no checkpoint policy; one of {REMAT_POLICIES}")


def layer_remat(cfg: ModelConfig) -> Callable[[Callable], Callable]:
    """A wrapper for the per-layer function, as ``nn.model.Transformer(remat=...)`` takes.

    Raises:
      ValueError: unknown ``remat_policy`` or bad ``remat_custom``.
    """
    if cfg.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={cfg.remat_policy!r} is not one of {REMAT_POLICIES}")
    if cfg.remat_policy != "custom" and cfg.remat_custom:
        raise ValueError(
            f"remat_custom is set but remat_policy={cfg.remat_policy!r}; use remat_policy=custom"
        )
    if cfg.remat_policy == "none":
        return lambda fn: fn
    policy = checkpoint_policy(cfg.remat_policy, cfg.remat_custom)
    # Inside scan, CSE cannot merge the recomputation with the forward pass, and
    # the barrier prevent_cse adds would only cost fusion; unrolled layers need it.
    prevent_cse = not cfg.scan_layers
    return lambda fn: jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)
