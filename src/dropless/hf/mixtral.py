"""Mixtral's Hugging Face tensor names (transformers' ``MixtralForCausalLM``).

The leaves, layouts and shared pieces are ``hf.leaves``'s; Mixtral is GQA
attention without q/k norm (``leaves.gqa_attention``) and an MoE layer in
every decoder layer. Two layouts of the same model (``leaves.LAYOUTS``):

* ``published`` (Mixtral-8x7B, Mixtral-8x22B as released, and what
  transformers 5's ``save_pretrained`` writes back): router
  ``model.layers.i.block_sparse_moe.gate.weight [E, D]`` and per-expert
  ``block_sparse_moe.experts.j.{w1,w3,w2}.weight``: w1 the gate ``[F, D]``,
  w3 the up projection ``[F, D]``, w2 the down projection ``[D, F]``;
* ``fused`` (transformers 5's state_dict): router ``mlp.gate.weight`` and
  ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows first),
  ``mlp.experts.down_proj [E, D, F]``.

There is no routing bias: each MoE layer's ``router_bias`` state is zeros on
load (``leaves.zeros``) and must be zero on export. Everything is exported in
the export dtype, the router included (Mixtral ships it in bf16). Both sides
use rotate-half RoPE on the projections as stored, so q and k need no feature
permutation.
"""

from dropless.config.sections import ModelConfig
from dropless.hf import leaves as L
from dropless.hf.leaves import Entry, ExpertNames, Mapping, linear

MODEL_TYPE = "mixtral"
PUBLISHED_EXPERTS = ExpertNames(prefix="block_sparse_moe.experts.", gate="w1", up="w3", down="w2")
__all__ = ["MODEL_TYPE", "writes", "mapping", "detect_layout"]


def writes(cfg: ModelConfig) -> bool:
    """Whether export writes ``cfg``'s model as Mixtral: GQA without q/k norm."""
    return cfg.attention_type == "gqa" and not cfg.gqa.use_qk_norm


def detect_layout(names) -> str:
    """``published`` (per-expert ``block_sparse_moe.experts.j.w1``...) or ``fused``.

    Raises:
      ValueError: names of both layouts.
    """
    return L.detect_layout(names, PUBLISHED_EXPERTS.prefix)


def _decoder_layer(cfg: ModelConfig, p: str, moe: bool, layout: str) -> list[Entry]:
    """The entries of ``model.layers.i`` (``p``); Mixtral's layers are all MoE."""
    block = "block_sparse_moe." if layout == "published" else "mlp."
    e = cfg.moe.num_experts

    def router(cfg: ModelConfig, p: str) -> list[Entry]:
        """The router, without a routing bias (its state loads as zeros)."""
        return [linear(("moe", "router", "kernel"), p + block + "gate.weight", cfg.emb_dim, e),
                L.zeros((None, "moe", "router_bias"), (e,))]

    return L.decoder_layer(cfg, p, moe, layout, L.gqa_attention, router, PUBLISHED_EXPERTS)


def mapping(cfg: ModelConfig, layout: str, hf_mtp_layers: int = 0) -> Mapping:
    """The ``Mapping`` of ``cfg``'s model onto ``layout``'s tensor names.

    Args:
      hf_mtp_layers: unused (Mixtral has no MTP layers); the loader's
        signature for every architecture.

    Raises:
      ValueError: an unknown layout, or a model with dense layers, shared
        experts or MTP layers (which Mixtral has no tensors for).
    """
    del hf_mtp_layers
    if cfg.first_num_dense_layers or cfg.moe.shared_experts or cfg.mtp_num_layers:
        raise ValueError("Mixtral has no dense layers, no shared experts and no MTP layers; got "
                         f"first_num_dense_layers={cfg.first_num_dense_layers}, "
                         f"shared_experts={cfg.moe.shared_experts}, mtp_num_layers={cfg.mtp_num_layers}")
    return Mapping(L.decoder(cfg, layout, _decoder_layer), aliases={})
