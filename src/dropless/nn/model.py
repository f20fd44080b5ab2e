"""The decoder: embedding, attention + (dense | MoE) layers, head, MTP.

Legend: B batch, S sequence, D model dim (``emb_dim``), V vocabulary, L layers
of one stack, E routed experts.

    h = embed(tokens)
    h = dense_layers(h)      first ``first_num_dense_layers`` layers, SwiGLU MLP
    h = moe_layers(h)        the rest, ``MoEBlock``
    logits = head(final_norm(h))                       untied output head

Each decoder layer is pre-norm: ``h += attention(norm(h)); h += FFN(norm(h))``,
the attention MLA (DeepSeek-V3) or GQA (Qwen3, Mixtral) by ``attention_type``. The
shapes the configs describe come from the same blocks: DeepSeek-V3 is MLA,
dense-first, MoE with a shared expert and sigmoid group-limited routing, MTP;
Qwen3-MoE is GQA with q/k norm, all MoE layers, softmax top-k routing; Mixtral
is Qwen3-MoE's blocks without the q/k norm (8 experts top-2).
Layers of one kind are built once with ``nnx.vmap`` (parameters stacked on a
leading [L] axis) and applied with ``jax.lax.scan``, so the traced and compiled
program holds one layer per stack whatever the depth.

Multi-token prediction (DeepSeek-V3 section 2.2), ``mtp_num_layers`` modules:
module k combines the previous depth's hidden state at position i with the
embedding of token i+k (``eh_proj([norm(emb); norm(h)])``), runs one decoder
layer and predicts token i+k+1 through the shared final-norm-less ``head``
after its own norm. The embedding and head are shared with the main model, as
in the paper (the released V3 checkpoint stores copies of both, which is why
its MTP module counts ~14B parameters and ours ~11.6B).

Rematerialisation is chosen by the trainer (``dropless.train.remat``) and
passed in as a function wrapper, because ``nn`` does not import ``train``.

``quantization: te_fp8_currentscaling`` computes the dense projections (MLA's
six or GQA's four, the dense MLP, the shared experts) with ``ops.fp8_dot.fp8_dot_general``;
the output head too when ``quantize_output_head`` is set; those with K or N
below ``fp8_min_dim`` stay in ``dtype`` (``bf16_dense_matmuls`` lists them).
The router, the embedding, the attention scores and MTP's ``eh_proj`` stay in
``dtype``. The routed experts follow ``moe.gmm_quantization`` instead.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dropless.config.sections import ModelConfig
from dropless.nn.attention import MLA, default_kernel_init
from dropless.nn.gqa import GQA
from dropless.nn.mlp import MLP
from dropless.nn.moe import MoEBlock, MoEStats
from dropless.ops.fp8_dot import fp8_dot_general, stays_plain
from dropless.parallel.ep import ExpertParallel

Remat = Callable[[Callable], Callable]
SUPPORTED_QUANTIZATION = ("", "te_fp8_currentscaling")
ATTENTION_TYPES = ("mla", "gqa")


def dense_dot_general(quantization: str, min_dim: int = 0, bf16_output: bool = False):
    """The ``dot_general`` of the dense projections for ``quantization`` (None: plain).

    ``min_dim`` and ``bf16_output``: ``fp8_dot_general``'s (products narrower than
    ``min_dim`` stay plain; ``bf16_output``: power-of-two scales and 16-bit GEMM
    outputs, config key ``fp8_dot_bf16_output``); unused without FP8 (the config
    refuses either set without it, and their defaults are inert).

    Raises:
      ValueError: an unknown quantization.
    """
    if quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"quantization={quantization!r} is not one of {SUPPORTED_QUANTIZATION}")
    if quantization != "te_fp8_currentscaling":
        return None
    keywords = {k: v for k, v in (("min_dim", min_dim), ("bf16_output", bf16_output)) if v}
    return functools.partial(fp8_dot_general, **keywords) if keywords else fp8_dot_general


def bf16_dense_matmuls(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of the dense matmuls that ``fp8_min_dim`` keeps out of FP8.

    Under ``quantization: te_fp8_currentscaling`` a projection whose
    contraction size K or output width N is below ``fp8_min_dim`` runs in
    ``dtype`` (``fp8_dot_general``'s ``min_dim``). Read from the model's own
    layers (built abstractly, no arrays): name is the module and projection
    (``attention/wq_a``, ``shared_experts/wo``), each (name, K, N) once
    whatever the number of layers. Empty without FP8 or with
    ``fp8_min_dim: 0``.
    """
    if cfg.quantization != "te_fp8_currentscaling" or not cfg.fp8_min_dim:
        return []
    return [row for row, plain in _fp8_dense_products(cfg) if plain]


def has_fp8_dense_matmuls(cfg: ModelConfig) -> bool:
    """Whether any dense projection runs in FP8 (``te_fp8_currentscaling`` and at least
    one product that ``fp8_min_dim`` lets through)."""
    if cfg.quantization != "te_fp8_currentscaling":
        return False
    return any(not plain for _, plain in _fp8_dense_products(cfg))


@functools.lru_cache(maxsize=8)
def _fp8_dense_products(cfg: ModelConfig) -> tuple[tuple[tuple[str, int, int], bool], ...]:
    """``((name, K, N), stays_plain)`` of each distinct projection built with
    ``fp8_dot_general``, read from the model built abstractly (no arrays); cached, since
    the start of a run asks twice (``bf16_dense_matmuls_line``, ``train.remat``)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    out = []
    for path, node in nnx.iter_graph(model):
        f = getattr(node, "dot_general", None) if isinstance(node, nnx.Linear) else None
        if f is fp8_dot_general:
            min_dim = 0
        elif isinstance(f, functools.partial) and f.func is fp8_dot_general:
            min_dim = f.keywords.get("min_dim", 0)
        else:
            continue
        row = ("/".join(map(str, path[-2:])), node.in_features, node.out_features)
        entry = (row, stays_plain(*row[1:], min_dim))
        if entry not in out:
            out.append(entry)
    return tuple(out)


def bf16_dense_matmuls_line(cfg: ModelConfig) -> str | None:
    """One line naming ``bf16_dense_matmuls(cfg)`` and how to quantize them all; None if empty."""
    rows = bf16_dense_matmuls(cfg)
    if not rows:
        return None
    names = ", ".join(f"{name} {k}x{n}" for name, k, n in rows)
    return (f"fp8_min_dim={cfg.fp8_min_dim}: these dense matmuls (K x N) stay bf16 under "
            f"quantization=te_fp8_currentscaling: {names}; fp8_min_dim=0 quantizes them all")


def make_attention(cfg: ModelConfig, *, rngs: nnx.Rngs, dot_general=None) -> nnx.Module:
    """The attention module ``cfg.attention_type`` names, built from its own section.

    Raises:
      ValueError: an unknown ``attention_type`` or an invalid section.
    """
    kw = dict(emb_dim=cfg.emb_dim, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.weight_dtype),
              rngs=rngs, dot_general=dot_general)
    if cfg.attention_type == "mla":
        return MLA(cfg.mla, **kw)
    if cfg.attention_type == "gqa":
        return GQA(cfg.gqa, **kw)
    raise ValueError(f"attention_type={cfg.attention_type!r} is not one of {ATTENTION_TYPES}")


def _identity(fn):
    return fn


class ModelOutput(NamedTuple):
    """What ``Transformer.__call__`` returns.

    logits_BSV: next-token logits, float32 (the head's dtype with ``float32_logits=False``).
    mtp_logits: one [B, S, V] array per MTP depth k, in the same dtype (position i
      predicts token i+k+1; the last k positions are meaningless and masked by
      the loss).
    moe_stats: MoEStats per MoE stack, keyed by the stack's path in the model
      (e.g. ``("moe_layers",)`` with fields stacked over [L], ``("mtp", 0)``).
    """

    logits_BSV: jax.Array
    mtp_logits: tuple
    moe_stats: dict


def _norm(cfg: ModelConfig, rngs):
    return nnx.RMSNorm(
        cfg.emb_dim, epsilon=cfg.normalization_layer_epsilon, dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs,
    )


class DecoderLayer(nnx.Module):
    """Pre-norm attention (MLA | GQA) + FFN block ``[B, S, D] -> [B, S, D]``; FFN dense or MoE."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs,
                 ep: ExpertParallel | None = None):
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        dot_general = dense_dot_general(cfg.quantization, cfg.fp8_min_dim, cfg.fp8_dot_bf16_output)
        self.is_moe = moe
        self.pre_attention_norm = _norm(cfg, rngs)
        self.attention = make_attention(cfg, rngs=rngs, dot_general=dot_general)
        self.pre_ffn_norm = _norm(cfg, rngs)
        if moe:
            self.moe = MoEBlock(
                cfg.moe, emb_dim=cfg.emb_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                ep=ep, dense_dot_general=dot_general,
            )
        else:
            self.mlp = MLP(cfg.emb_dim, cfg.mlp_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                           dot_general=dot_general)

    def __call__(self, x_BSD, positions_BS) -> tuple[jax.Array, MoEStats | None]:
        """Returns the new hidden state and the MoE stats (None for a dense layer)."""
        x_BSD = checkpoint_name(x_BSD, "decoder_layer_input")
        h_BSD = x_BSD + self.attention(self.pre_attention_norm(x_BSD), positions_BS)
        if self.is_moe:
            y_BSD, stats = self.moe(self.pre_ffn_norm(h_BSD))
        else:
            y_BSD, stats = self.mlp(self.pre_ffn_norm(h_BSD)), None
        return (h_BSD + y_BSD).astype(x_BSD.dtype), stats


class LayerStack(nnx.Module):
    """``num_layers`` identical decoder layers, parameters stacked on a leading [L] axis."""

    def __init__(self, cfg: ModelConfig, *, num_layers: int, moe: bool, rngs: nnx.Rngs,
                 ep: ExpertParallel | None = None):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return DecoderLayer(cfg, moe=moe, rngs=rngs, ep=ep)

        self.layers = create(rngs)
        self.num_layers = num_layers
        self.scan_layers = cfg.scan_layers

    def __call__(self, x_BSD, positions_BS, remat: Remat = _identity):
        """Apply the L layers in order; MoE stats come back stacked on [L] (or None)."""
        graphdef, state = nnx.split(self.layers)

        def body(x, layer_state):
            return nnx.merge(graphdef, layer_state)(x, positions_BS)

        if self.scan_layers:
            return jax.lax.scan(remat(body), x_BSD, state)
        # Unrolled: same parameters, one traced copy per layer (compile time grows with L).
        # Each layer takes its slice of the stacked parameters inside the rematerialised
        # function, so the backward pass slices again instead of keeping the slices as
        # residuals (a copy of every layer's weights).
        stats = []
        for i in range(self.num_layers):
            def layer(x, stacked, i=i):
                return body(x, jax.tree.map(lambda a: a[i], stacked))

            x_BSD, s = remat(layer)(x_BSD, state)
            stats.append(s)
        return x_BSD, jax.tree.map(lambda *a: jnp.stack(a), *stats)


class MTPModule(nnx.Module):
    """One multi-token-prediction depth: ``eh_proj``, a decoder layer, a norm."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs,
                 ep: ExpertParallel | None = None):
        self.hidden_norm = _norm(cfg, rngs)
        self.embed_norm = _norm(cfg, rngs)
        self.eh_proj = nnx.Linear(
            2 * cfg.emb_dim, cfg.emb_dim, use_bias=False, dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.weight_dtype), kernel_init=default_kernel_init, rngs=rngs,
        )
        self.layer = DecoderLayer(cfg, moe=moe, rngs=rngs, ep=ep)
        self.final_norm = _norm(cfg, rngs)

    def __call__(self, h_BSD, emb_BSD, positions_BS, remat: Remat = _identity):
        """h: previous depth's hidden state; emb: embeddings of tokens shifted by k."""
        x_BSD = self.eh_proj(jnp.concatenate([self.embed_norm(emb_BSD), self.hidden_norm(h_BSD)], -1))
        graphdef, state = nnx.split(self.layer)
        h_BSD, stats = remat(lambda x, s: nnx.merge(graphdef, s)(x, positions_BS))(x_BSD, state)
        return h_BSD, self.final_norm(h_BSD), stats


class Transformer(nnx.Module):
    """Decoder-only MoE language model (DeepSeek-V3-, Qwen3-MoE- or Mixtral-style by its config).

    Args:
      cfg: the model section; parameters in ``weight_dtype``, activations in ``dtype``.
      rngs: parameter initialisation keys.
      remat: wraps the per-layer function ``(x, layer_state) -> (x, stats)``,
        e.g. ``jax.checkpoint`` with a policy; identity by default.
      ep: run the MoE layers' experts expert-parallel over this mesh (None:
        single device).

    Raises:
      ValueError: inconsistent layer counts or an invalid sub-config.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: Remat | None = None,
                 ep: ExpertParallel | None = None):
        if cfg.num_decoder_layers <= 0:
            raise ValueError(f"num_decoder_layers={cfg.num_decoder_layers} must be positive")
        if not 0 <= cfg.first_num_dense_layers <= cfg.num_decoder_layers:
            raise ValueError(
                f"first_num_dense_layers={cfg.first_num_dense_layers} must be in "
                f"[0, num_decoder_layers={cfg.num_decoder_layers}]"
            )
        if cfg.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers={cfg.mtp_num_layers} must be >= 0")
        dot_general = dense_dot_general(cfg.quantization, cfg.fp8_min_dim, cfg.fp8_dot_bf16_output)  # raises for an unknown value
        if cfg.quantize_output_head and dot_general is None:
            raise ValueError("quantize_output_head=True needs quantization='te_fp8_currentscaling'")
        head_dot_general = dot_general if cfg.quantize_output_head else None
        self.cfg = cfg
        self.remat = remat or _identity
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        n_dense = cfg.first_num_dense_layers
        n_moe = cfg.num_decoder_layers - n_dense
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.emb_dim, dtype=dtype, param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(1.0), rngs=rngs,
        )
        self.dense_layers = LayerStack(cfg, num_layers=n_dense, moe=False, rngs=rngs) if n_dense else None
        self.moe_layers = (
            LayerStack(cfg, num_layers=n_moe, moe=True, rngs=rngs, ep=ep) if n_moe else None
        )
        self.final_norm = _norm(cfg, rngs)
        self.head = nnx.Linear(
            cfg.emb_dim, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
            kernel_init=default_kernel_init, dot_general=head_dot_general or jax.lax.dot_general,
            rngs=rngs,
        )
        # The MTP layer has the kind of the model's last layer (MoE in V3).
        self.mtp = nnx.List(
            [MTPModule(cfg, moe=n_moe > 0, rngs=rngs, ep=ep) for _ in range(cfg.mtp_num_layers)]
        )

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None, *,
                 float32_logits: bool = True) -> ModelOutput:
        """tokens [B, S] int -> ModelOutput; positions default to 0..S-1.

        ``float32_logits=False`` returns the logits in the head's dtype (bf16 under a bf16
        ``dtype``), for a loss that reads them as they are (the trainer's,
        ``ops.cross_entropy``: its backward then writes their gradient in that dtype).

        Raises:
          ValueError: tokens not rank 2.
        """
        if tokens_BS.ndim != 2:
            raise ValueError(f"tokens must be [B, S], got shape {tokens_BS.shape}")
        b, s = tokens_BS.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        emb_BSD = self.embed(tokens_BS)
        h_BSD, moe_stats = emb_BSD, {}
        if self.dense_layers is not None:
            h_BSD, _ = self.dense_layers(h_BSD, positions_BS, self.remat)
        if self.moe_layers is not None:
            h_BSD, moe_stats[("moe_layers",)] = self.moe_layers(h_BSD, positions_BS, self.remat)
        cast = (lambda v: v.astype(jnp.float32)) if float32_logits else (lambda v: v)
        logits_BSV = cast(self.head(self.final_norm(h_BSD)))
        mtp_logits = []
        for k, module in enumerate(self.mtp, start=1):
            # Position i sees token i+k; the wrapped-around last k positions are masked by the loss.
            h_BSD, normed_BSD, stats = module(
                h_BSD, jnp.roll(emb_BSD, -k, axis=1), positions_BS, self.remat
            )
            mtp_logits.append(cast(self.head(normed_BSD)))
            if stats is not None:
                moe_stats[("mtp", k - 1)] = stats
        return ModelOutput(logits_BSV, tuple(mtp_logits), moe_stats)

    def apply_router_bias_update(self, moe_stats: dict) -> None:
        """One balancing step of each stack's RouterBias from its load (in place).

        ``moe_stats`` as ``ModelOutput.moe_stats`` (under gradient accumulation
        with ``tokens_per_expert`` summed over the microbatches); each stack's
        ``MoEBlock.update_router_bias`` gets its ``tokens_per_expert``. Called by
        the trainer after the optimizer step.
        """
        for path, stats in moe_stats.items():
            module = self
            for part in path:
                module = module[part] if isinstance(part, int) else getattr(module, part)
            for _, block in nnx.iter_graph(module):
                if isinstance(block, MoEBlock):
                    block.update_router_bias(stats.tokens_per_expert)


def count_params(model: nnx.Module) -> int:
    """Number of ``nnx.Param`` elements (works on ``nnx.eval_shape`` models too)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def moe_stats_concat(moe_stats: dict) -> MoEStats | None:
    """All MoE layers' stats as one MoEStats with a leading [L_total] axis (None if no MoE).

    A scanned stack contributes its [L] rows, an MTP layer one row.
    """
    if not moe_stats:
        return None
    rows = []
    for stats in moe_stats.values():
        stacked = stats.tokens_per_expert.ndim == 2
        rows.append(stats if stacked else jax.tree.map(lambda a: a[None], stats))
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *rows)


def moe_layer_names(cfg: ModelConfig) -> list[str]:
    """Names of the MoE layers in the row order of ``moe_stats_concat``.

    ``"decoder layer i"`` (0-based over all decoder layers) for the MoE stack,
    then ``"mtp k"`` for each MTP module with an MoE layer.
    """
    n_dense = cfg.first_num_dense_layers
    n_moe = cfg.num_decoder_layers - n_dense
    names = [f"decoder layer {n_dense + i}" for i in range(n_moe)]
    if n_moe:
        names += [f"mtp {k}" for k in range(cfg.mtp_num_layers)]
    return names
