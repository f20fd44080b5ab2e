"""Qwen3-MoE's Hugging Face tensor names (transformers' ``Qwen3MoeForCausalLM``).

The leaves, layouts and shared pieces are ``hf.leaves``'s; this module adds
GQA attention with its per-head q/k norms and the MoE layer's router. Two
layouts of the same model (``leaves.LAYOUTS``):

* ``published`` (Qwen3-30B-A3B, Qwen3-235B-A22B as released): per-expert
  ``model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight``;
* ``fused`` (transformers 5): ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate
  rows first) and ``mlp.experts.down_proj [E, D, F]`` per layer.

Layers listed in config.json's ``mlp_only_layers`` (a prefix ``[0, n)``, as
``config.hf_config`` checks) are dropless's dense-first layers: a SwiGLU
``mlp.{gate,up,down}_proj`` of width ``intermediate_size``.

There is no routing bias: each MoE layer's ``router_bias`` state is zeros on
load (``leaves.zeros``) and must be zero on export. Everything is exported in
the export dtype, the router included (Qwen3 ships it in bf16). Both sides use
rotate-half RoPE on the projections as stored, so q and k need no feature
permutation.
"""

from dropless.config.sections import ModelConfig
from dropless.hf import leaves as L
from dropless.hf.leaves import Entry, Mapping, detect_layout, linear

MODEL_TYPE = "qwen3_moe"
__all__ = ["MODEL_TYPE", "writes", "mapping", "detect_layout"]


def writes(cfg: ModelConfig) -> bool:
    """Whether export writes ``cfg``'s model as Qwen3-MoE: GQA with q/k norm."""
    return cfg.attention_type == "gqa" and cfg.gqa.use_qk_norm


def _router(cfg: ModelConfig, p: str) -> list[Entry]:
    """The MoE layer's router; no routing bias (its state loads as zeros)."""
    e = cfg.moe.num_experts
    return [linear(("moe", "router", "kernel"), p + "mlp.gate.weight", cfg.emb_dim, e),
            L.zeros((None, "moe", "router_bias"), (e,))]


def _decoder_layer(cfg: ModelConfig, p: str, moe: bool, layout: str) -> list[Entry]:
    """The entries of ``model.layers.i`` (``p``), dense (``mlp_only_layers``) or MoE."""
    return L.decoder_layer(cfg, p, moe, layout, L.gqa_attention, _router)


def mapping(cfg: ModelConfig, layout: str, hf_mtp_layers: int = 0) -> Mapping:
    """The ``Mapping`` of ``cfg``'s model onto ``layout``'s tensor names.

    Args:
      hf_mtp_layers: unused (Qwen3-MoE has no MTP layers); the loader's
        signature for every architecture.

    Raises:
      ValueError: an unknown layout, or a model with shared experts or MTP
        layers (which Qwen3-MoE has no tensors for).
    """
    del hf_mtp_layers
    if cfg.moe.shared_experts or cfg.mtp_num_layers:
        raise ValueError("Qwen3-MoE has no shared experts and no MTP layers; "
                         f"got shared_experts={cfg.moe.shared_experts}, mtp_num_layers={cfg.mtp_num_layers}")
    return Mapping(L.decoder(cfg, layout, _decoder_layer), aliases={})
