"""DeepSeek-V3's Hugging Face tensor names, mapped onto dropless's parameters.

The leaves, layouts and shared pieces are ``hf.leaves``'s; this module adds
MLA attention, the MoE layer's router, balancing bias and shared experts, and
the MTP layers. Two layouts of the same model (``leaves.LAYOUTS``):

* ``published`` (DeepSeek-V3 as released): per-expert
  ``model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight``; the MTP layers
  follow the decoder as ``model.layers.{N+k}.*`` with ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm`` and copies of the embedding
  (``embed_tokens``) and head (``shared_head.head``), which dropless shares
  with the main model: they are checked equal to the main ones, not loaded.
* ``fused`` (transformers 5): ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate
  rows first) and ``mlp.experts.down_proj [E, D, F]`` per layer.

The router weight and bias are float32 in the published checkpoint and are
exported so. RoPE needs no permutation: config.json's ``rope_interleave=true``
(checked by ``config.hf_config``) is the interleaved pair layout ``nn.rope``
computes.
"""

from dropless.config.sections import ModelConfig
from dropless.hf import leaves as L
from dropless.hf.leaves import Entry, Mapping, detect_layout, leaf, linear, vector

MODEL_TYPE = "deepseek_v3"
__all__ = ["MODEL_TYPE", "writes", "mapping", "detect_layout"]


def writes(cfg: ModelConfig) -> bool:
    """Whether export writes ``cfg``'s model as DeepSeek-V3: every MLA model."""
    return cfg.attention_type == "mla"


def _attention(cfg: ModelConfig, p: str) -> list[Entry]:
    mla, d = cfg.mla, cfg.emb_dim
    h, q = mla.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = p + "self_attn."
    out = []
    if mla.q_lora_rank > 0:
        out += [
            linear(("attention", "wq_a", "kernel"), a + "q_a_proj.weight", d, mla.q_lora_rank),
            vector(("attention", "q_norm", "scale"), a + "q_a_layernorm.weight", mla.q_lora_rank),
            linear(("attention", "wq_b", "kernel"), a + "q_b_proj.weight", mla.q_lora_rank, h * q),
        ]
    else:
        out.append(linear(("attention", "wq", "kernel"), a + "q_proj.weight", d, h * q))
    return out + [
        linear(("attention", "wkv_a", "kernel"), a + "kv_a_proj_with_mqa.weight", d,
               mla.kv_lora_rank + mla.qk_rope_head_dim),
        vector(("attention", "kv_norm", "scale"), a + "kv_a_layernorm.weight", mla.kv_lora_rank),
        linear(("attention", "wkv_b", "kernel"), a + "kv_b_proj.weight", mla.kv_lora_rank,
               h * (mla.qk_nope_head_dim + mla.v_head_dim)),
        linear(("attention", "wo", "kernel"), a + "o_proj.weight", h * mla.v_head_dim, d),
    ]


def _router(cfg: ModelConfig, p: str) -> list[Entry]:
    """The MoE layer's router and balancing bias (float32 as published) and shared experts."""
    d, e = cfg.emb_dim, cfg.moe.num_experts
    return [
        linear(("moe", "router", "kernel"), p + "mlp.gate.weight", d, e, float32=True),
        vector((None, "moe", "router_bias"), p + "mlp.gate.e_score_correction_bias", e, float32=True),
        *L.mlp(("moe", "shared_experts"), p + "mlp.shared_experts.", d,
               cfg.moe.shared_experts * cfg.moe.moe_mlp_dim),
    ]


def _decoder_layer(cfg: ModelConfig, p: str, moe: bool, layout: str) -> list[Entry]:
    """The entries of ``model.layers.i`` (``p``), dense or MoE."""
    return L.decoder_layer(cfg, p, moe, layout, _attention, _router)


def mapping(cfg: ModelConfig, layout: str, hf_mtp_layers: int = 0) -> Mapping:
    """The ``Mapping`` of ``cfg``'s model onto ``layout``'s tensor names.

    Args:
      hf_mtp_layers: MTP layers the directory holds; those past
        ``cfg.mtp_num_layers`` are skipped, not unexpected.

    Raises:
      ValueError: an unknown layout.
    """
    d, n = cfg.emb_dim, cfg.num_decoder_layers
    leaves = L.decoder(cfg, layout, _decoder_layer)
    aliases = {}
    for k in range(cfg.mtp_num_layers):
        p = f"model.layers.{n + k}."
        entries = [
            vector(("embed_norm", "scale"), p + "enorm.weight", d),
            vector(("hidden_norm", "scale"), p + "hnorm.weight", d),
            linear(("eh_proj", "kernel"), p + "eh_proj.weight", 2 * d, d),
            vector(("final_norm", "scale"), p + "shared_head.norm.weight", d),
        ]
        for path, *rest in _decoder_layer(cfg, p, n > cfg.first_num_dense_layers, layout):
            bias = path[0] is None
            entries.append((((None,) if bias else ()) + ("layer",) + (path[1:] if bias else path), *rest))
        leaves += [leaf(("mtp", k), e) for e in entries]
        aliases[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
        aliases[p + "shared_head.head.weight"] = "lm_head.weight"
    skipped = tuple(f"model.layers.{n + k}." for k in range(cfg.mtp_num_layers, hf_mtp_layers))
    return Mapping(leaves, aliases, skipped)
