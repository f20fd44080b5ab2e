"""Mixture-of-Experts block: router -> dispatch -> grouped SwiGLU experts -> combine.

Legend: B batch, S sequence, T = B*S tokens, D model dim (``emb_dim``),
F expert hidden dim (``moe_mlp_dim``), E routed experts, K experts per token,
P rows of the expert-sorted buffer, C expert capacity (baseline path only).

The dropless path (``sparse_matmul=True``)::

    logits_TE = router(x)                    float32
    weights_TK, experts_TK = route(logits)   ops.routing
    x_PD, plan = dispatch(x_TD, experts_TK)  ops.permute
    h_PF2 = gmm(x_PD, wi_ED2F)               gate|up in one grouped matmul
    y_PD = gmm(silu(gate) * up, wo_EFD)
    out_TD = combine(y_PD, weights_TK)       weighted inverse permutation
             + shared_experts(x_TD)

No token is ever dropped: the buffer has static size T*K (plus alignment
padding) and each expert takes however many rows it was sent. Gradients reach
the router through the combine weights.

``gmm_quantization`` (``te_mxfp8`` | ``te_fp8_blockwise``) runs the three
products of both grouped matmuls with that recipe's FP8 numerics
(``ops.gmm.quantized``); the group alignment the recipe needs (32 | 128) is
applied to the permutation automatically (the max with ``group_alignment``).
``gmm_fp8_impl`` picks how ``te_fp8_blockwise`` runs: ``kernel``, the FP8
Mosaic GPU kernels (Hopper), ``emulate``, or ``auto`` (the default: the
kernels where they can run; ``quantized.resolve_impl``).
The shared experts take the dense layers' ``dot_general`` from the model.

Given an ``ExpertParallel`` (``ep``), dispatch -> experts -> combine run
expert-parallel over its mesh (``parallel.ep.routed_experts``): tokens are
exchanged with the ranks holding their experts and come back combined. The
exchange's receive buffers are bounded, so there a load past
``ragged_buffer_factor`` can overflow: ``MoEStats.overflow_tokens`` counts it
and the trainer skips such a step. Without ``ep`` (or with one expert rank)
the code is the single-device path above.

The baseline path (``sparse_matmul=False``) is MaxText's capacity-limited
``dense_matmul``: one-hot dispatch/combine einsums into an [E, C, D] buffer,
C = ceil(capacity_factor * T * K / E); copies past C are dropped and counted.
It is kept to compare against, not as an equal option.

The aux-loss-free balancing bias lives in a ``RouterBias`` variable, not an
``nnx.Param``: optimizers filtered on ``nnx.Param`` skip it, and after the
optimizer step the train step calls ``MoEBlock.update_router_bias`` with the
step's load (``MoEStats.tokens_per_expert``).
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dropless.config.sections import MoEConfig
from dropless.nn.mlp import MLP
from dropless.ops import permute as permute_ops
from dropless.ops import routing
from dropless.ops.gmm import BACKENDS, quantized
from dropless.parallel import ep as ep_lib

SUPPORTED_QUANTIZATION = quantized.RECIPES

# Fan-in over D (axis -2); the expert axis 0 is a batch of independent matrices.
expert_kernel_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing bias [E] float32 (DeepSeek-V3).

    Not an ``nnx.Param``, so optimizers filtered on Param skip it; the train
    step moves it with ``MoEBlock.update_router_bias``.
    """


class Fp8WeightCodes(nnx.Variable):
    """The FP8 codes of a block's expert weights, ``{name: quantized.weight_codes(w)}``,
    attached for one optimizer step (``attach_fp8_weight_codes``): not a parameter,
    never saved, absent from the model's own state."""


class WeightWithCodes(NamedTuple):
    """An expert weight [E, ...] and its ``quantized.weight_codes`` (a pytree whose
    leaves all lead with E, so expert parallelism splits both alike)."""

    w: jax.Array
    codes: tuple


class MoEStats(NamedTuple):
    """Per-call statistics of an MoE block (a pytree).

    tokens_per_expert: [E] int32 token copies the router sent to each expert.
    dropped_tokens: [] int32 copies dropped for capacity (0 on the dropless path).
    aux_loss: [] float32, already weighted: load-balance + sequence aux + z-loss.
    overflow_tokens: [] int32 token rows the expert-parallel exchange could
      not compute for lack of receive buffer (always 0 on one device); a step
      with any must not be applied.
    buffer_factor_needed: [] float32 smallest ``ragged_buffer_factor`` that
      would have held this call's load on every rank (0 without exchange).
      Across microbatches it combines by max, not sum.
    ep_rows_sent: [] int32 token rows sent to other expert ranks (deduplicated).
    ep_rows_saved: [] int32 rows per-expert sending would have added; times
      D x itemsize, the bytes deduplication saved.
    ep_extra_rounds: [] int32 extra exchange rounds and grouped-matmul passes
      run for a load larger than the buffers (``ep_overflow_rounds``).
    """

    tokens_per_expert: jax.Array
    dropped_tokens: jax.Array
    aux_loss: jax.Array
    overflow_tokens: jax.Array
    buffer_factor_needed: jax.Array
    ep_rows_sent: jax.Array
    ep_rows_saved: jax.Array
    ep_extra_rounds: jax.Array


def dispatch(x_TD, experts_TK, num_experts, alignment=1):
    """Local dispatch: sort token copies by expert into a [P, D] buffer.

    Returns ``(x_PD, plan)``; ``plan.group_sizes_E`` are the gmm group sizes.
    Expert parallelism replaces this with an exchange across ranks.
    """
    plan = permute_ops.make_plan(experts_TK, num_experts, alignment)
    return permute_ops.permute(x_TD, plan), plan


def combine(y_PD, weights_TK, plan):
    """Local combine: ``out_TD[t] = sum_j weights_TK[t, j] * y(copy t*K+j)``."""
    return permute_ops.unpermute(y_PD, weights_TK, plan)


def grouped_swiglu(x_PD, group_sizes_G, weights, *, backend, quantization="te_no_quant",
                   fp8_impl="auto", fp8_quantizer="auto", fp8_kernel_schedule="default",
                   fp8_fused_swiglu=False):
    """SwiGLU experts over an expert-sorted buffer: [P, D] -> [P, D].

    Args:
      x_PD: [P, D] rows grouped by expert, in expert order.
      group_sizes_G: [G] int32 rows per expert; rows past their sum give zeros.
        Multiples of ``quantized.required_alignment(quantization)``.
      weights: ``(wi [G, D, 2F], wo [G, F, D])`` (gate|up fused) or
        ``(wi_0 [G, D, F], wi_1 [G, D, F], wo [G, F, D])``, in x's dtype; each may
        come as a ``WeightWithCodes``, whose FP8 codes the kernels then read instead
        of quantizing the weight.
      backend: the gmm backend.
      quantization: the grouped-GEMM recipe (``quantized.RECIPES``).
      fp8_impl: ``quantized.IMPLS``: auto, emulate, or the FP8 kernels (te_fp8_blockwise).
      fp8_quantizer: ``quantized.QUANT_IMPLS``: how the FP8 kernels' operands are quantized.
      fp8_kernel_schedule: ``quantized.KERNEL_SCHEDULES``: how the FP8 kernels schedule
        their steps (the same bits with each).
      fp8_fused_swiglu: with the fused gate|up weight, hand the down projection gate|up
        itself (``quantized.gmm(prologue="swiglu")``): where the FP8 kernels run, SwiGLU's
        output is quantized in the pass that computes it; elsewhere the same as without.
    """

    def grouped(x, w, name, prologue=None):
        w, codes = w if isinstance(w, WeightWithCodes) else (w, None)
        y = quantized.gmm(x, w, group_sizes_G, recipe=quantization, backend=backend,
                          impl=fp8_impl, groups_aligned=True,  # the contract above
                          quant_impl=fp8_quantizer, kernel_schedule=fp8_kernel_schedule,
                          w_codes=codes, prologue=prologue)
        # The barrier gives the kernel's output one user. In a scan that saves it
        # (remat ``minimal``) it would also feed the dynamic-update-slice into the
        # stacked residual, and XLA's GPU dynamic-slice fusion then runs a second
        # copy of the kernel that writes the residual in place while the first
        # feeds the layer: each forward grouped GEMM twice per layer
        # (benchmarks/notes/scan.md). At run time the barrier is a no-op.
        return checkpoint_name(jax.lax.optimization_barrier(y), name)

    *gate_up, w_out = weights
    if fp8_fused_swiglu and len(gate_up) == 1:
        return grouped(grouped(x_PD, gate_up[0], "moe_mlpwi"), w_out, "moe_mlpwo", "swiglu")
    if len(gate_up) == 1:
        gate_PF, up_PF = jnp.split(grouped(x_PD, gate_up[0], "moe_mlpwi"), 2, axis=-1)
    else:
        gate_PF = grouped(x_PD, gate_up[0], "moe_mlpwi")
        up_PF = grouped(x_PD, gate_up[1], "moe_mlpwi")
    return grouped(jax.nn.silu(gate_PF) * up_PF, w_out, "moe_mlpwo")


def expert_capacity(num_tokens, k, num_experts, capacity_factor):
    """Rows per expert on the capacity path: ceil(capacity_factor * T * K / E)."""
    return max(1, math.ceil(capacity_factor * num_tokens * k / num_experts))


def capacity_masks(experts_TK, weights_TK, num_experts, capacity):
    """One-hot dispatch/combine tensors of the capacity baseline.

    Copies queue for their expert in (token, slot) order; a copy whose place
    in the queue is >= ``capacity`` is dropped.

    Returns:
      dispatch_TEC: [T, E, C] float32 0/1; combine_TEC: [T, E, C] float32
      (router weights at kept places); dropped: [] int32 number of dropped copies.
    """
    t, k = experts_TK.shape
    onehot_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.int32)
    queue_TKE = jnp.cumsum(onehot_TKE.reshape(t * k, num_experts), axis=0).reshape(
        t, k, num_experts
    )
    place_TK = jnp.sum((queue_TKE - 1) * onehot_TKE, axis=-1)
    kept_TK = place_TK < capacity
    # one_hot of a place >= capacity is all zeros: dropped copies vanish here.
    place_TKC = jax.nn.one_hot(place_TK, capacity, dtype=jnp.float32)
    onehot_TKE = onehot_TKE.astype(jnp.float32)
    dispatch_TEC = jnp.einsum("tke,tkc->tec", onehot_TKE, place_TKC)
    combine_TEC = jnp.einsum("tke,tkc,tk->tec", onehot_TKE, place_TKC, weights_TK)
    dropped = jnp.sum(~kept_TK).astype(jnp.int32)
    return dispatch_TEC, combine_TEC, dropped


def _check_config(cfg: MoEConfig):
    routing.check_routing_args(
        cfg.num_experts, cfg.num_experts_per_tok, cfg.n_routing_groups, cfg.topk_routing_group
    )
    if cfg.routed_score_func not in routing.SCORE_FUNCS:
        raise ValueError(f"{cfg.routed_score_func=} is not one of {routing.SCORE_FUNCS}")
    if cfg.moe_mlp_dim <= 0 or cfg.shared_experts < 0:
        raise ValueError(f"{cfg.moe_mlp_dim=} must be > 0 and {cfg.shared_experts=} >= 0")
    if cfg.group_alignment < 1:
        raise ValueError(f"{cfg.group_alignment=} must be >= 1")
    if not cfg.sparse_matmul and cfg.capacity_factor <= 0:
        raise ValueError(f"{cfg.capacity_factor=} must be > 0 on the capacity path")
    if cfg.gmm_backend not in BACKENDS:
        raise ValueError(f"{cfg.gmm_backend=} is not one of {BACKENDS}")
    if cfg.gmm_quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"{cfg.gmm_quantization=} is not one of {SUPPORTED_QUANTIZATION}")
    if cfg.gmm_quantization != "te_no_quant" and not cfg.sparse_matmul:
        raise ValueError(f"{cfg.gmm_quantization=} quantizes the grouped GEMMs of the dropless "
                         "path; the capacity baseline (sparse_matmul=False) has none")
    if cfg.gmm_fp8_impl not in quantized.IMPLS:
        raise ValueError(f"{cfg.gmm_fp8_impl=} is not one of {quantized.IMPLS}")
    if cfg.gmm_fp8_quantizer not in quantized.QUANT_IMPLS:
        raise ValueError(f"{cfg.gmm_fp8_quantizer=} is not one of {quantized.QUANT_IMPLS}")
    if cfg.gmm_fp8_kernel_schedule not in quantized.KERNEL_SCHEDULES:
        raise ValueError(f"{cfg.gmm_fp8_kernel_schedule=} is not one of "
                         f"{tuple(quantized.KERNEL_SCHEDULES)}")
    if cfg.gmm_fp8_impl == "kernel" and cfg.gmm_quantization != quantized.KERNEL_RECIPE:
        raise ValueError(f"{cfg.gmm_fp8_impl=} has kernels for gmm_quantization="
                         f"{quantized.KERNEL_RECIPE} only, got {cfg.gmm_quantization=}")


def fp8_impls(cfg: MoEConfig, emb_dim: int, rows: int, dtype) -> dict | None:
    """How each grouped matmul's FP8 recipe runs on this process's devices:
    ``{"wi": "kernel" | "emulate", "wo": ...}`` (``quantized.resolve_impl`` at the
    block's shapes, ``rows`` buffer rows), or None without an FP8 recipe."""
    if not cfg.sparse_matmul or cfg.gmm_quantization == "te_no_quant":
        return None
    d, f, e = emb_dim, cfg.moe_mlp_dim, cfg.num_experts
    gate_up = 2 * f if cfg.prefuse_moe_weights else f  # wi, or each of wi_0 and wi_1
    shapes = {"wi": ((rows, d), (e, d, gate_up)), "wo": ((rows, f), (e, f, d))}
    return {name: quantized.resolve_impl(cfg.gmm_fp8_impl, cfg.gmm_quantization, cfg.gmm_backend,
                                         x, w, dtype)[0] for name, (x, w) in shapes.items()}


# Rows per expert (per micro-batch, balanced routing) below which te_fp8_blockwise's
# grouped GEMMs cost more than bf16's: the expert weights are quantized once per
# forward, 4 bytes of HBM traffic per weight element (a bf16 read, both code layouts
# written) at about 4 TB/s, i.e. K N x 1e-12 s per expert, while FP8 saves 6 r K N x
# (1/765 - 1/1000) x 1e-12 s on the three GEMMs (H200: bf16 kernels about 765 TF/s,
# FP8 about 1,000 with the activations' quantization); they balance at r of about 550.
# Measured on one H200 with training's quantizers: 0.74-0.75x bf16 at 256 rows per
# expert (``gmm-g256-k2048-n7168-blockwise-20261204-1256-h200``), 1.04-1.12x at 2,048
# (``gmm-g32-blockwise-20261203-2201-h200``).
FP8_BREAK_EVEN_ROWS = 550


def rows_per_local_expert(cfg: MoEConfig, tokens_per_device: int, expert_parallelism: int) -> float:
    """Rows a local expert's grouped GEMMs get per micro-batch under balanced routing: the
    expert-parallel group's tokens times top-k, over all experts."""
    return tokens_per_device * expert_parallelism * cfg.num_experts_per_tok / cfg.num_experts


def fp8_rows_line(cfg: MoEConfig, rows_per_expert: float) -> str | None:
    """One line when ``te_fp8_blockwise`` grouped GEMMs get too few rows per expert to pay
    for quantizing the expert weights every step (``FP8_BREAK_EVEN_ROWS``); None otherwise."""
    if cfg.gmm_quantization != quantized.KERNEL_RECIPE or rows_per_expert >= FP8_BREAK_EVEN_ROWS:
        return None
    return (f"te_gmm_quantization={cfg.gmm_quantization}: about {rows_per_expert:,.0f} rows per "
            f"expert per micro-batch; below about {FP8_BREAK_EVEN_ROWS} the expert weights' FP8 "
            "quantization (every step) costs more than the FP8 grouped GEMMs save (one H200: "
            "0.74x bf16 at 256 rows, 1.04-1.12x at 2,048); more tokens per device, more expert "
            "parallelism or te_gmm_quantization=te_no_quant would be faster")


def group_alignment(cfg: MoEConfig) -> int:
    """Rows per expert are padded to a multiple of this: ``group_alignment``, raised to
    what the grouped-GEMM quantization recipe needs (its scale blocks run along rows)."""
    return max(cfg.group_alignment, quantized.required_alignment(cfg.gmm_quantization))


class MoEBlock(nnx.Module):
    """Routed SwiGLU experts plus optional shared experts: [B, S, D] -> [B, S, D].

    Parameters (``param_dtype``; computed in ``dtype``, router in float32):
      ``router.kernel`` [D, E];
      ``wi`` [E, D, 2F] (gate | up) if ``prefuse_moe_weights``, else
      ``wi_0`` [E, D, F] (gate) and ``wi_1`` [E, D, F] (up);
      ``wo`` [E, F, D];
      ``shared_experts`` an ``MLP`` of width ``shared_experts * moe_mlp_dim``.
    State: ``router_bias`` a ``RouterBias`` [E], present even when
    ``routed_bias`` is off so every MoE layer has the same state structure.

    ``ep``: run the routed experts expert-parallel over its mesh (parameters
    and activations are then expected sharded per ``parallel.sharding``);
    None: single device (or plain jit partitioning).
    ``dense_dot_general``: the matmul of the shared experts (the dense
    layers' FP8 ``dot_general`` under ``te_fp8_currentscaling``; None: plain).

    Raises:
      ValueError: an invalid config, or E not divisible by the expert ranks.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        emb_dim: int,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        ep: ep_lib.ExpertParallel | None = None,
        dense_dot_general=None,
    ):
        _check_config(cfg)
        if ep is not None and cfg.num_experts % ep.ranks:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the "
                             f"{ep.ranks} expert-parallel ranks")
        if ep is not None and not cfg.sparse_matmul and ep.ranks > 1:
            raise ValueError("expert parallelism needs sparse_matmul=True (the capacity "
                             "baseline runs on one device)")
        self.cfg = cfg
        self.ep = ep
        self.emb_dim = emb_dim
        self.dtype = dtype
        e, d, f = cfg.num_experts, emb_dim, cfg.moe_mlp_dim
        self.router = nnx.Linear(
            d, e, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
            precision=jax.lax.Precision.HIGHEST, rngs=rngs,
        )
        self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32))

        def expert_param(shape):
            return nnx.Param(expert_kernel_init(rngs.params(), shape, param_dtype))

        if cfg.prefuse_moe_weights:
            self.wi = expert_param((e, d, 2 * f))
        else:
            self.wi_0 = expert_param((e, d, f))
            self.wi_1 = expert_param((e, d, f))
        self.wo = expert_param((e, f, d))
        self.shared_experts = (
            MLP(d, cfg.shared_experts * f, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                dot_general=dense_dot_general)
            if cfg.shared_experts > 0
            else None
        )

    def _route(self, x_TD):
        cfg = self.cfg
        logits_TE = self.router(x_TD.astype(jnp.float32))
        decision = routing.route(
            logits_TE,
            k=cfg.num_experts_per_tok,
            score_func=cfg.routed_score_func,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            bias_E=self.router_bias[...] if cfg.routed_bias else None,
            n_groups=cfg.n_routing_groups,
            topk_groups=cfg.topk_routing_group,
        )
        return logits_TE, decision

    def _gate_up_weights(self):
        """(gate, up) weights [E, D, F] each, or the fused [E, D, 2F] and None."""
        if self.cfg.prefuse_moe_weights:
            return self.wi[...].astype(self.dtype), None
        return self.wi_0[...].astype(self.dtype), self.wi_1[...].astype(self.dtype)

    def _expert_weights(self):
        """(wi, wo) or (wi_0, wi_1, wo), each [E, ...] in ``dtype``."""
        w_gate, w_up = self._gate_up_weights()
        gate_up = (w_gate,) if w_up is None else (w_gate, w_up)
        return (*gate_up, self.wo[...].astype(self.dtype))

    def _hoistable_fp8_weights(self) -> tuple[bool, str]:
        """(whether the FP8 kernels will read this block's expert weights, so that their
        codes can be computed once per optimizer step, ``fp8_weight_codes``; why not)."""
        cfg = self.cfg
        if not cfg.sparse_matmul or cfg.gmm_quantization != quantized.KERNEL_RECIPE:
            return False, ""
        for w in self._expert_weights():
            impl, _ = quantized.resolve_impl(cfg.gmm_fp8_impl, cfg.gmm_quantization,
                                             cfg.gmm_backend, None, w.shape[-3:], self.dtype)
            if impl != "kernel":
                return False, ""  # the emulation: its own log line says so
        if self.ep is not None and self.ep.mesh.size > 1:
            return False, (f"expert parallelism over {self.ep.mesh.size} devices: the codes "
                           "would be computed outside the expert-parallel region")
        return True, ""

    def fp8_weight_codes(self) -> dict:
        """``{name: quantized.weight_codes(w)}`` of the expert weights as the FP8 kernels
        read them (in ``dtype``, [(L,) E, ...]), or {} where the kernels do not read them
        (another recipe, the emulation, expert parallelism over several devices)."""
        if not self._hoistable_fp8_weights()[0]:
            return {}
        names = self._expert_weight_names()
        return {name: quantized.weight_codes(w, self.cfg.gmm_fp8_quantizer)
                for name, w in zip(names, self._expert_weights())}

    def _expert_weight_names(self):
        gate_up = ("wi",) if self.cfg.prefuse_moe_weights else ("wi_0", "wi_1")
        return (*gate_up, "wo")

    def _expert_operands(self):
        """``_expert_weights``, each paired with its codes where ``Fp8WeightCodes`` are attached."""
        weights = self._expert_weights()
        codes = getattr(self, "fp8_codes", None)
        if codes is None:
            return weights
        codes = codes.get_value()
        return tuple(WeightWithCodes(w, codes[name])
                     for name, w in zip(self._expert_weight_names(), weights))

    def _experts_sparse(self, x_PD, group_sizes_E):
        """Grouped SwiGLU over the expert-sorted buffer: [P, D] -> [P, D]."""
        return grouped_swiglu(x_PD, group_sizes_E, self._expert_operands(),
                              backend=self.cfg.gmm_backend,
                              quantization=self.cfg.gmm_quantization,
                              fp8_impl=self.cfg.gmm_fp8_impl,
                              fp8_quantizer=self.cfg.gmm_fp8_quantizer,
                              fp8_kernel_schedule=self.cfg.gmm_fp8_kernel_schedule,
                              fp8_fused_swiglu=self.cfg.gmm_fp8_fused_swiglu)

    def _experts_dense(self, x_ECD):
        """Batched SwiGLU over per-expert capacity buffers: [E, C, D] -> [E, C, D]."""

        def batched(x, w, name):
            return checkpoint_name(jnp.einsum("ecd,edf->ecf", x, w), name)

        w_gate, w_up = self._gate_up_weights()
        if w_up is None:
            gate_ECF, up_ECF = jnp.split(batched(x_ECD, w_gate, "moe_mlpwi"), 2, axis=-1)
        else:
            gate_ECF = batched(x_ECD, w_gate, "moe_mlpwi")
            up_ECF = batched(x_ECD, w_up, "moe_mlpwi")
        a_ECF = jax.nn.silu(gate_ECF) * up_ECF
        return batched(a_ECF, self.wo[...].astype(self.dtype), "moe_mlpwo")

    def _dropless(self, x_TD, decision):
        """Dispatch -> grouped experts -> combine (over ``ep`` when given); nothing dropped."""
        e = self.cfg.num_experts
        out_TD, ep_stats = ep_lib.routed_experts(
            x_TD, decision.experts_TK, decision.weights_TK, self._expert_operands(),
            functools.partial(grouped_swiglu, backend=self.cfg.gmm_backend,
                              quantization=self.cfg.gmm_quantization,
                              fp8_impl=self.cfg.gmm_fp8_impl,
                              fp8_quantizer=self.cfg.gmm_fp8_quantizer,
                              fp8_kernel_schedule=self.cfg.gmm_fp8_kernel_schedule,
                              fp8_fused_swiglu=self.cfg.gmm_fp8_fused_swiglu),
            num_experts=e, alignment=group_alignment(self.cfg), ep=self.ep,
        )
        tokens_E = routing.tokens_per_expert(decision.experts_TK, e)
        return out_TD, tokens_E, jnp.zeros((), jnp.int32), ep_stats

    def _with_capacity(self, x_TD, decision):
        """The MaxText-style baseline: one-hot einsums into [E, C, D] buffers."""
        cfg = self.cfg
        e = cfg.num_experts
        capacity = expert_capacity(
            x_TD.shape[0], cfg.num_experts_per_tok, e, cfg.capacity_factor
        )
        dispatch_TEC, combine_TEC, dropped = capacity_masks(
            decision.experts_TK, decision.weights_TK, e, capacity
        )
        x_ECD = jnp.einsum("tec,td->ecd", dispatch_TEC.astype(self.dtype), x_TD)
        y_ECD = self._experts_dense(x_ECD)
        out_TD = jnp.einsum(
            "tec,ecd->td", combine_TEC, y_ECD, preferred_element_type=jnp.float32
        ).astype(self.dtype)
        return out_TD, routing.tokens_per_expert(decision.experts_TK, e), dropped

    def _aux_loss(self, logits_TE, decision, batch, seq):
        cfg = self.cfg
        func = cfg.routed_score_func
        aux = jnp.zeros((), jnp.float32)
        # Static weights: a loss with weight 0 is not even traced.
        if cfg.load_balance_loss_weight:
            lb = routing.load_balance_loss(decision.scores_TE, decision.experts_TK, func)
            aux += cfg.load_balance_loss_weight * lb
        if cfg.seq_aux_loss_weight:
            seq_loss = routing.seq_aux_loss(
                decision.scores_TE.reshape(batch, seq, -1),
                decision.experts_TK.reshape(batch, seq, -1),
                func,
            )
            aux += cfg.seq_aux_loss_weight * seq_loss
        if cfg.router_z_loss_weight:
            aux += cfg.router_z_loss_weight * routing.router_z_loss(logits_TE)
        return aux

    def update_router_bias(self, tokens_per_expert_E: jax.Array) -> None:
        """One aux-loss-free balancing step of ``router_bias`` from a load (in place).

        ``router_bias += routed_bias_update_rate * sign(mean_load - load)``
        (``routing.bias_update``); nothing when ``routed_bias`` is off. Call it
        after the optimizer step with ``MoEStats.tokens_per_expert``, summed over
        the step's microbatches under gradient accumulation (one step per
        optimizer step: averaging per-microbatch signs would let opposite signs
        cancel).

        Args:
          tokens_per_expert_E: [..., E] int load; on a layer stack built with
            ``nnx.vmap`` (``router_bias`` [L, E]) the stack's [L, E] load.
        """
        if self.cfg.routed_bias:
            step = routing.bias_update(tokens_per_expert_E, self.cfg.routed_bias_update_rate)
            self.router_bias[...] = self.router_bias[...] + step.astype(self.router_bias.dtype)

    def __call__(self, x_BSD: jax.Array) -> tuple[jax.Array, MoEStats]:
        """Apply the block.

        Args:
          x_BSD: [B, S, D] activations, any float dtype.

        Returns:
          ``(y_BSD, stats)``: y in ``dtype``; ``stats`` an ``MoEStats``.

        Raises:
          ValueError: x is not [B, S, emb_dim].
        """
        if x_BSD.ndim != 3 or x_BSD.shape[-1] != self.emb_dim:
            raise ValueError(f"MoEBlock: expected [B, S, {self.emb_dim}], got {x_BSD.shape}")
        cfg = self.cfg
        b, s, d = x_BSD.shape
        x_TD = x_BSD.reshape(b * s, d)
        logits_TE, decision = self._route(x_TD)
        x_TD = x_TD.astype(self.dtype)
        if cfg.sparse_matmul:
            out_TD, tokens_E, dropped, ep_stats = self._dropless(x_TD, decision)
        else:
            out_TD, tokens_E, dropped = self._with_capacity(x_TD, decision)
            ep_stats = ep_lib.EPStats.zeros()
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        stats = MoEStats(
            tokens_per_expert=tokens_E,
            dropped_tokens=dropped,
            aux_loss=self._aux_loss(logits_TE, decision, b, s),
            overflow_tokens=ep_stats.overflow_tokens,
            buffer_factor_needed=ep_stats.buffer_factor_needed,
            ep_rows_sent=ep_stats.rows_sent,
            ep_rows_saved=ep_stats.rows_saved,
            ep_extra_rounds=ep_stats.extra_rounds,
        )
        return out_TD.reshape(b, s, d), stats


def fp8_weight_codes(model: nnx.Module) -> dict[str, dict]:
    """The FP8 codes of every MoE block's expert weights in ``model`` that the FP8
    kernels read, keyed by the block's path ("a/b/c"); see ``MoEBlock.fp8_weight_codes``.

    With ``gmm_fp8_weights_once_per_step`` the trainer computes them once per optimizer
    step, before the gradient-accumulation loop, and attaches them to each microbatch's
    model (``attach_fp8_weight_codes``): the same codes, so the same bits, as quantizing
    in every microbatch, for both byte layouts held through the step.
    """
    codes = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, MoEBlock) and (c := node.fp8_weight_codes()):
            codes["/".join(map(str, path))] = c
    return codes


def fp8_weight_codes_refusals(model: nnx.Module) -> list[str]:
    """Why the FP8 expert weights of ``model`` cannot be quantized once per optimizer
    step, one line per reason (empty when they can, or when no kernel reads them)."""
    whys = (node._hoistable_fp8_weights()[1] for _, node in nnx.iter_graph(model)
            if isinstance(node, MoEBlock))
    return sorted({why for why in whys if why})


def attach_fp8_weight_codes(model: nnx.Module, codes: dict[str, dict]) -> None:
    """Give each MoE block of ``model`` its codes from ``fp8_weight_codes`` (in place;
    the model must have the structure the codes were computed from).

    Raises:
      ValueError: a block path in ``codes`` that ``model`` does not have.
    """
    blocks = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model)
              if isinstance(node, MoEBlock)}
    if unknown := sorted(set(codes) - set(blocks)):
        raise ValueError(f"attach_fp8_weight_codes: no MoE block at {unknown}")
    for path, c in codes.items():
        blocks[path].fp8_codes = Fp8WeightCodes(c)
