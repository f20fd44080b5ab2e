"""A Hugging Face ``config.json`` as dropless config keys, and back.

``hf_model_path=DIR`` makes the model's keys (shapes, RoPE, routing) come from
``DIR/config.json``; ``apply_hf_config`` does that inside the loader. A key
the user also gave (config file, command line, environment) must agree with
the directory or it is a one-line contradiction naming both values; keys from
``base.yml`` or the model preset are simply replaced. ``mtp_num_layers`` may
be given lower than the directory's MTP depth (its extra MTP layers are then
not loaded), never higher.

One reader per ``model_type`` (``READERS``), each a function
``config.json dict -> {key: value}``, and one writer (``WRITERS``, a model
section -> the published config.json) for ``export-hf``: DeepSeek-V3's,
Qwen3-MoE's and Mixtral's. Anything of the file that dropless's model cannot compute the
same way is a ``HFConfigError`` naming it, never a
silently different model.
"""

import json
import os
from typing import Any, Callable


class HFConfigError(ValueError):
    """A Hugging Face config.json that is missing, unreadable or describes an unsupported model."""


def _require(hf: dict, checks, keys, model_type: str) -> None:
    """Refuse a config.json whose ``checks`` keys (key, the only value supported) differ
    or that lacks one of ``keys``.

    Raises:
      HFConfigError: the first such key.
    """
    for key, want in checks:
        if key in hf and hf[key] != want:
            raise HFConfigError(f"config.json {key}={hf[key]!r} is not supported (only {want!r})")
    missing = [k for k in keys if k not in hf]
    if missing:
        raise HFConfigError(f"config.json has no {missing[0]!r} (model_type {model_type})")

def read_config_json(path: str) -> dict:
    """``DIR/config.json`` as a dict.

    Raises:
      HFConfigError: no directory, no config.json, or invalid JSON.
    """
    if not os.path.isdir(path):
        raise HFConfigError(f"hf_model_path={path!r}: no such directory")
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HFConfigError(f"hf_model_path={path!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{file} must hold a JSON object")
    return data


# --- DeepSeek-V3 ---------------------------------------------------------------

# dropless key <- config.json key, for values copied as they are.
DEEPSEEK_V3_KEYS = {
    "vocab_size": "vocab_size",
    "emb_dim": "hidden_size",
    "num_decoder_layers": "num_hidden_layers",
    "first_num_dense_layers": "first_k_dense_replace",
    "mlp_dim": "intermediate_size",
    "num_query_heads": "num_attention_heads",
    "normalization_layer_epsilon": "rms_norm_eps",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_mlp_dim": "moe_intermediate_size",
    "shared_experts": "n_shared_experts",
    "n_routing_groups": "n_group",
    "topk_routing_group": "topk_group",
    "routed_scaling_factor": "routed_scaling_factor",
    "norm_topk_prob": "norm_topk_prob",
}
# transformers' DeepSeek-V3 normalises the two MLA latents with RMSNorm's default
# epsilon whatever rms_norm_eps says; dropless has one epsilon for all norms.
_LATENT_NORM_EPS = 1e-6


def _rope(hf: dict) -> dict:
    """The RoPE dict of either layout: transformers 5 ``rope_parameters`` or
    the published ``rope_scaling`` + ``rope_theta``.

    Raises:
      HFConfigError: a ``partial_rotary_factor`` other than 1, in the RoPE dict
        or at the top level, whatever the rope type (dropless rotates the whole
        rotary head dim: all of ``qk_rope_head_dim`` in MLA, of ``head_dim`` in GQA).
    """
    if hf.get("rope_parameters"):
        rope = dict(hf["rope_parameters"])
    else:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise HFConfigError(f"config.json partial_rotary_factor={partial} is not supported "
                            "(RoPE over the whole rotary head dim only)")
    return rope


def _rope_keys(hf: dict) -> dict:
    rope = _rope(hf)
    keys = {"rope_max_timescale": float(rope["rope_theta"])}
    kind = rope["rope_type"]
    if kind == "default":
        return {**keys, "rope_factor": 1.0}
    if kind != "yarn":
        raise HFConfigError(f"config.json rope type {kind!r} is not supported (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise HFConfigError(f"config.json YaRN attention_factor={rope['attention_factor']} is not supported")
    if rope.get("truncate", True) is not True:
        raise HFConfigError("config.json YaRN with truncate=false is not supported")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not mscale_all_dim:
        # transformers: cos/sin times mscale(factor, 1), softmax scale untouched.
        mscale, mscale_all_dim = 1.0, 0.0
    elif not mscale:
        raise HFConfigError("config.json YaRN with mscale_all_dim but no mscale is not supported")
    return {
        **keys,
        "rope_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
    }


def deepseek_v3_keys(hf: dict) -> dict[str, Any]:
    """dropless keys of a DeepSeek-V3 config.json (published or transformers 5).

    Raises:
      HFConfigError: a missing key or a feature dropless's model does not compute.
    """
    checks = (
        ("hidden_act", "silu"), ("tie_word_embeddings", False), ("attention_bias", False),
        ("rope_interleave", True), ("moe_layer_freq", 1), ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
    )
    _require(hf, checks, DEEPSEEK_V3_KEYS.values(), "deepseek_v3")
    if hf["rms_norm_eps"] != _LATENT_NORM_EPS:
        raise HFConfigError(f"config.json rms_norm_eps={hf['rms_norm_eps']} is not supported: "
                            f"transformers' MLA latent norms use {_LATENT_NORM_EPS} whatever it says")
    if not hf["n_shared_experts"]:
        raise HFConfigError("config.json n_shared_experts=0 is not supported for deepseek_v3")
    keys = {ours: hf[theirs] for ours, theirs in DEEPSEEK_V3_KEYS.items()}
    keys["q_lora_rank"] = hf.get("q_lora_rank") or 0
    keys["mtp_num_layers"] = int(hf.get("num_nextn_predict_layers") or 0)
    keys.update(decoder_block="deepseek", attention_type="mla", use_qk_norm=False)
    keys["routed_score_func"] = "sigmoid"
    keys["routed_bias"] = True  # e_score_correction_bias: selection bias of every MoE layer
    keys.update(_rope_keys(hf))
    return keys


def deepseek_v3_config(model, *, torch_dtype: str) -> dict:
    """The published DeepSeek-V3 config.json of a ``sections.ModelConfig``.

    Raises:
      HFConfigError: a model the DeepSeek-V3 layout cannot describe.
    """
    moe, mla = model.moe, model.mla
    if moe.routed_score_func != "sigmoid" or not moe.routed_bias:
        raise HFConfigError("export to deepseek_v3 needs routed_score_func=sigmoid and routed_bias=true")
    if moe.shared_experts < 1:
        raise HFConfigError("export to deepseek_v3 needs shared_experts >= 1")
    if model.normalization_layer_epsilon != _LATENT_NORM_EPS:
        raise HFConfigError(f"export to deepseek_v3 needs normalization_layer_epsilon={_LATENT_NORM_EPS}")
    groups = moe.n_routing_groups if moe.n_routing_groups > 0 else 1
    topk_groups = moe.topk_routing_group if moe.topk_routing_group > 0 else 1
    rope_scaling = None
    if mla.rope_factor > 1.0:
        rope_scaling = {
            "type": "yarn", "factor": mla.rope_factor,
            "original_max_position_embeddings": mla.original_max_position_embeddings,
            "beta_fast": mla.beta_fast, "beta_slow": mla.beta_slow,
            "mscale": mla.mscale, "mscale_all_dim": mla.mscale_all_dim,
        }
        if not mla.mscale_all_dim and mla.mscale != 1.0:
            raise HFConfigError("export: YaRN with mscale_all_dim=0 needs mscale=1")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_dim,
        "intermediate_size": model.mlp_dim,
        "moe_intermediate_size": moe.moe_mlp_dim,
        "num_hidden_layers": model.num_decoder_layers,
        "num_nextn_predict_layers": model.mtp_num_layers,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "n_shared_experts": moe.shared_experts,
        "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank or None,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "n_group": groups,
        "topk_group": topk_groups,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_layer_freq": 1,
        "first_k_dense_replace": model.first_num_dense_layers,
        "norm_topk_prob": moe.norm_topk_prob,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": int(mla.original_max_position_embeddings * max(mla.rope_factor, 1.0)),
        "rms_norm_eps": model.normalization_layer_epsilon,
        "tie_word_embeddings": False,
        "rope_theta": mla.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": torch_dtype,
    }


# --- Qwen3-MoE --------------------------------------------------------------------

# dropless key <- config.json key, for values copied as they are.
QWEN3_MOE_KEYS = {
    "vocab_size": "vocab_size",
    "emb_dim": "hidden_size",
    "num_decoder_layers": "num_hidden_layers",
    "mlp_dim": "intermediate_size",
    "num_query_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "normalization_layer_epsilon": "rms_norm_eps",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_mlp_dim": "moe_intermediate_size",
}
# What decoder_block=qwen3_moe fixes (config.schema.DECODER_BLOCKS), set so that a
# preset's other values give way to the directory's model.
_QWEN3_MOE_FIXED = {
    "decoder_block": "qwen3_moe", "attention_type": "gqa", "use_qk_norm": True, "shared_experts": 0,
    "routed_score_func": "softmax", "routed_bias": False, "routed_scaling_factor": 1.0,
    "routed_bias_update_rate": 0.0, "mtp_num_layers": 0, "n_routing_groups": -1, "topk_routing_group": -1,
    "rope_factor": 1.0,
}


def _default_rope_theta(hf: dict, model_type: str) -> float:
    """``rope_theta`` of a GQA config.json (either layout) whose RoPE is the default.

    Raises:
      HFConfigError: any other rope type (YaRN, linear, ...), or as ``_rope``.
    """
    rope = _rope(hf)
    if rope["rope_type"] != "default":
        raise HFConfigError(f"config.json rope type {rope['rope_type']!r} (rope_scaling / rope_parameters) "
                            f"is not supported for {model_type} (only default RoPE)")
    return float(rope["rope_theta"])


def _gqa_head_dim(hf: dict) -> int:
    """``head_dim``, or transformers' default hidden_size // num_attention_heads
    where the key is absent or null (Mixtral's published config.json)."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _require_export(needs, model_type: str) -> None:
    """Refuse an export whose ``needs`` (key, the model's value, the only value
    ``model_type`` can hold) differ.

    Raises:
      HFConfigError: the first such key, both values named.
    """
    for key, value, want in needs:
        if value != want:
            raise HFConfigError(f"export to {model_type} needs {key}={want!r}, got {value!r}")


def _router_aux_loss_coef(moe) -> float:
    """transformers' ``router_aux_loss_coef`` of dropless's balancing-loss weight:
    transformers' loss sums over the k slots, k times dropless's."""
    return moe.load_balance_loss_weight / moe.num_experts_per_tok


def _dense_prefix(hf: dict) -> int:
    """``first_num_dense_layers`` of ``mlp_only_layers``, which must be ``[0, n)``."""
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    if dense != list(range(len(dense))):
        raise HFConfigError(f"config.json mlp_only_layers={hf['mlp_only_layers']} is not supported "
                            "(only a prefix [0, 1, ..., n-1]: dropless's dense layers come first)")
    return len(dense)


def qwen3_moe_keys(hf: dict) -> dict[str, Any]:
    """dropless keys of a Qwen3-MoE config.json (published or transformers 5).

    transformers 5 writes ``num_experts`` as ``num_local_experts``. Absent
    optional keys take transformers' ``Qwen3MoeConfig`` defaults
    (``norm_topk_prob`` false, ``head_dim`` hidden_size // num_attention_heads,
    no ``mlp_only_layers``, ``decoder_sparse_step`` 1).

    Raises:
      HFConfigError: a missing key or a feature dropless's model does not
        compute the same way (named, with its value).
    """
    if "num_local_experts" in hf:  # transformers 5's name for num_experts
        if hf.get("num_experts", hf["num_local_experts"]) != hf["num_local_experts"]:
            raise HFConfigError(f"config.json num_experts={hf['num_experts']} and "
                                f"num_local_experts={hf['num_local_experts']} differ")
        hf = {**hf, "num_experts": hf["num_local_experts"]}
    checks = (
        ("hidden_act", "silu"), ("tie_word_embeddings", False), ("attention_bias", False),
        ("use_sliding_window", False), ("decoder_sparse_step", 1),
    )
    _require(hf, checks, QWEN3_MOE_KEYS.values(), "qwen3_moe")
    if hf["num_experts"] < 1:
        raise HFConfigError(f"config.json num_experts={hf['num_experts']} is not supported "
                            "(a Qwen3-MoE with experts; dense Qwen3 is model_type qwen3)")
    rope_theta = _default_rope_theta(hf, "qwen3_moe")
    keys = {ours: hf[theirs] for ours, theirs in QWEN3_MOE_KEYS.items()}
    keys.update(_QWEN3_MOE_FIXED)
    keys["head_dim"] = _gqa_head_dim(hf)
    keys["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
    keys["first_num_dense_layers"] = _dense_prefix(hf)
    keys["rope_max_timescale"] = rope_theta
    return keys


def qwen3_moe_config(model, *, torch_dtype: str) -> dict:
    """The published Qwen3-MoE config.json of a ``sections.ModelConfig``.

    Raises:
      HFConfigError: a model the Qwen3-MoE layout cannot describe (named key).
    """
    moe, gqa = model.moe, model.gqa
    needs = (
        ("attention_type", model.attention_type, "gqa"), ("use_qk_norm", gqa.use_qk_norm, True),
        ("shared_experts", moe.shared_experts, 0), ("routed_score_func", moe.routed_score_func, "softmax"),
        ("routed_bias", moe.routed_bias, False), ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
        ("n_routing_groups", moe.n_routing_groups, -1), ("mtp_num_layers", model.mtp_num_layers, 0),
    )
    _require_export(needs, "qwen3_moe")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_dim,
        "intermediate_size": model.mlp_dim,
        "moe_intermediate_size": moe.moe_mlp_dim,
        "num_hidden_layers": model.num_decoder_layers,
        "mlp_only_layers": list(range(model.first_num_dense_layers)),
        "decoder_sparse_step": 1,
        "num_attention_heads": gqa.num_heads,
        "num_key_value_heads": gqa.num_kv_heads,
        "head_dim": gqa.head_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "norm_topk_prob": moe.norm_topk_prob,
        "router_aux_loss_coef": _router_aux_loss_coef(moe),
        "output_router_logits": False,
        "hidden_act": "silu",
        "rms_norm_eps": model.normalization_layer_epsilon,
        "tie_word_embeddings": False,
        "rope_theta": gqa.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": torch_dtype,
    }


# --- Mixtral ----------------------------------------------------------------------

# dropless key <- config.json key, for values copied as they are.
MIXTRAL_KEYS = {
    "vocab_size": "vocab_size",
    "emb_dim": "hidden_size",
    "num_decoder_layers": "num_hidden_layers",
    "moe_mlp_dim": "intermediate_size",
    "num_query_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "normalization_layer_epsilon": "rms_norm_eps",
    "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok",
}
# What decoder_block=mixtral fixes (config.schema.DECODER_BLOCKS), set so that a
# preset's other values give way to the directory's model.
_MIXTRAL_FIXED = {
    "decoder_block": "mixtral", "attention_type": "gqa", "use_qk_norm": False, "shared_experts": 0,
    "first_num_dense_layers": 0, "routed_score_func": "softmax", "norm_topk_prob": True,
    "routed_bias": False, "routed_scaling_factor": 1.0, "routed_bias_update_rate": 0.0,
    "mtp_num_layers": 0, "n_routing_groups": -1, "topk_routing_group": -1, "rope_factor": 1.0,
}


def mixtral_keys(hf: dict) -> dict[str, Any]:
    """dropless keys of a Mixtral config.json (published or transformers 5).

    Every layer is MoE, routed by a softmax over all experts, top-k,
    renormalised (transformers' ``MixtralTopKRouter`` has no switch for it).
    ``mlp_dim`` (the width of a dense layer, which Mixtral has none of) is set
    to the experts' ``intermediate_size``. Absent optional keys take
    ``MixtralConfig``'s defaults (``head_dim`` hidden_size // num_attention_heads).

    Raises:
      HFConfigError: a missing key or a feature dropless's model does not
        compute the same way (named, with its value), e.g. a sliding window.
    """
    if hf.get("sliding_window") is not None:
        raise HFConfigError(f"config.json sliding_window={hf['sliding_window']!r} is not supported "
                            "(only null: dropless's attention is full causal)")
    checks = (("hidden_act", "silu"), ("tie_word_embeddings", False), ("router_jitter_noise", 0.0))
    _require(hf, checks, MIXTRAL_KEYS.values(), "mixtral")
    rope_theta = _default_rope_theta(hf, "mixtral")
    keys = {ours: hf[theirs] for ours, theirs in MIXTRAL_KEYS.items()}
    keys.update(_MIXTRAL_FIXED)
    keys["mlp_dim"] = hf["intermediate_size"]
    keys["head_dim"] = _gqa_head_dim(hf)
    keys["rope_max_timescale"] = rope_theta
    return keys


def mixtral_config(model, *, torch_dtype: str) -> dict:
    """The published Mixtral config.json of a ``sections.ModelConfig``.

    Raises:
      HFConfigError: a model the Mixtral layout cannot describe (named key).
    """
    moe, gqa = model.moe, model.gqa
    needs = (
        ("attention_type", model.attention_type, "gqa"), ("use_qk_norm", gqa.use_qk_norm, False),
        ("first_num_dense_layers", model.first_num_dense_layers, 0),
        ("shared_experts", moe.shared_experts, 0), ("routed_score_func", moe.routed_score_func, "softmax"),
        ("norm_topk_prob", moe.norm_topk_prob, True), ("routed_bias", moe.routed_bias, False),
        ("routed_scaling_factor", moe.routed_scaling_factor, 1.0),
        ("n_routing_groups", moe.n_routing_groups, -1), ("mtp_num_layers", model.mtp_num_layers, 0),
    )
    _require_export(needs, "mixtral")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_dim,
        "intermediate_size": moe.moe_mlp_dim,
        "num_hidden_layers": model.num_decoder_layers,
        "num_attention_heads": gqa.num_heads,
        "num_key_value_heads": gqa.num_kv_heads,
        "head_dim": gqa.head_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "router_aux_loss_coef": _router_aux_loss_coef(moe),
        "output_router_logits": False,
        "hidden_act": "silu",
        "rms_norm_eps": model.normalization_layer_epsilon,
        "tie_word_embeddings": False,
        "rope_theta": gqa.rope_theta,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "torch_dtype": torch_dtype,
    }


READERS: dict[str, Callable[[dict], dict]] = {
    "deepseek_v3": deepseek_v3_keys, "qwen3_moe": qwen3_moe_keys, "mixtral": mixtral_keys}
# The published config.json of a model section, by model_type (``hf.export``).
WRITERS: dict[str, Callable[..., dict]] = {
    "deepseek_v3": deepseek_v3_config, "qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config}


def model_keys(hf: dict) -> dict[str, Any]:
    """dropless keys of a config.json, by its ``model_type``.

    Raises:
      HFConfigError: an unknown model_type or an unsupported feature.
    """
    model_type = hf.get("model_type")
    reader = READERS.get(model_type)
    if reader is None:
        raise HFConfigError(f"config.json model_type={model_type!r} is not supported "
                            f"(supported: {', '.join(sorted(READERS))})")
    return reader(hf)


def apply_hf_config(values: dict, sources: dict, explicit: set[str]) -> None:
    """Set the model keys of ``values['hf_model_path']``'s config.json in place.

    Args:
      values, sources: the loader's merged key values and their sources.
      explicit: source labels the user gave (config file, command line,
        environment); a key from one of them must agree with config.json.

    Raises:
      HFConfigError: as ``read_config_json`` / ``model_keys``, or a
        contradiction between a given key and config.json (both values named).
    """
    path = values["hf_model_path"]
    label = os.path.join(path, "config.json")
    for key, value in model_keys(read_config_json(path)).items():
        src = sources.get(key)
        if src in explicit and key in values:
            given = values[key]
            ok = given == value or (key == "mtp_num_layers" and 0 <= given <= value)
            if not ok:
                raise HFConfigError(f"{key}={given!r} (from {src}) contradicts {label}, which gives {value!r}")
            continue
        values[key] = value
        sources[key] = label
