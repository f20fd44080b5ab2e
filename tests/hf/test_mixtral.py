"""Mixtral through hf_model_path, forward and export-hf, against transformers.

The fixture (``tools/make_hf_fixture_mixtral.py``, ``fixtures/mixtral``) is a
tiny random ``MixtralForCausalLM`` made by transformers 5.24 in float32: 3
layers, all MoE, GQA 4 query / 2 kv heads of head_dim 8 (no ``head_dim`` key,
as the published config.json), no q/k norm, softmax top-2 of 8 experts
renormalised, no shared expert, untied embeddings, ``sliding_window: null``;
its logits and routed experts, in the published (``block_sparse_moe``,
per-expert w1/w3/w2, sharded; what transformers' save_pretrained also writes)
and transformers 5 (fused ``mlp.experts``) layouts.

Tolerance of the parity: both sides run float32 on the same weights
(bf16-representable, so the bf16 files are exact) and differ only in the
order of float32 sums (matmul blocking, softmax and RMSNorm reductions), a
few 2^-24 relative per op over <= 128-term sums; through 3 layers that is
~1e-6 relative Frobenius error in the logits (measured 1.4e-6). The bound is
1e-4. Top-1 tokens and routed experts must agree exactly: the smallest router
margin (k-th minus (k+1)-th probability, ``meta.json``) is 6.4e-4, far above
that error.
"""

import dataclasses
import os

import numpy as np
import parity
import pytest
from hf_fixture import MIXTRAL, load_params, model_cfg

from dropless.config import hf_config
from dropless.config.loader import ConfigError, load_config
from dropless.hf.export import write_hf

LAYOUTS = ("published", "fused")
BOUND = 1e-4  # relative Frobenius error of the logits, derived above


def _config_json(layout="published") -> dict:
    return hf_config.read_config_json(os.path.join(MIXTRAL, layout))


# --- config.json ------------------------------------------------------------------

def test_both_layouts_give_the_mixtral_model_keys():
    """published (rope_theta, no head_dim) and transformers 5 (rope_parameters,
    head_dim null) give the same keys: the fixture's shapes and Mixtral's structure."""
    pub, fused = (hf_config.model_keys(_config_json(layout)) for layout in LAYOUTS)
    assert pub == fused
    assert (pub["num_query_heads"], pub["num_kv_heads"], pub["head_dim"]) == (4, 2, 8)
    assert (pub["num_experts"], pub["num_experts_per_tok"], pub["first_num_dense_layers"]) == (8, 2, 0)
    assert (pub["decoder_block"], pub["attention_type"], pub["use_qk_norm"]) == ("mixtral", "gqa", False)
    assert pub["norm_topk_prob"] and pub["routed_score_func"] == "softmax" and pub["rope_max_timescale"] == 1e6
    assert pub["moe_mlp_dim"] == 32 and pub["normalization_layer_epsilon"] == 1e-5


@pytest.mark.parametrize("change, words", [
    ({"sliding_window": 4096}, "sliding_window=4096"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "'yarn'"),
])
def test_what_dropless_cannot_compute_is_refused_naming_the_key(tmp_path, change, words):
    parity.assert_refused(tmp_path, {**_config_json(), **change}, words)


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b"])
def test_written_config_json_reads_back_as_the_preset(preset):
    """mixtral_config is the inverse of mixtral_keys on the published shapes."""
    cfg = load_config(None, [f"model_name={preset}"]).config
    keys = hf_config.model_keys(hf_config.mixtral_config(cfg.model(), torch_dtype="bfloat16"))
    assert keys == {k: getattr(cfg, k) for k in keys}


def test_a_key_given_against_the_directory_is_a_contradiction():
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"hf_model_path={os.path.join(MIXTRAL, 'published')}", "num_kv_heads=4"])
    assert "contradicts" in str(e.value) and "num_kv_heads=4" in str(e.value)
    # A Mixtral preset's keys give way to the directory's (no contradiction).
    cfg = load_config(None, [f"hf_model_path={os.path.join(MIXTRAL, 'published')}",
                             "model_name=mixtral-8x7b"]).config
    assert (cfg.emb_dim, cfg.head_dim, cfg.vocab_size) == (32, 8, 128)


# --- parity -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_command_matches_transformers_logits(tmp_path, layout):
    parity.assert_forward_command_matches(MIXTRAL, layout, tmp_path, bound=BOUND)


def test_routed_experts_match_transformers(monkeypatch):
    """Each layer sends each token to the experts transformers' router picked."""
    loaded = parity.assert_routes_as_transformers(MIXTRAL, "published", monkeypatch, bound=BOUND)
    # Mixtral has no routing bias: the state dropless keeps for one is zeros.
    assert not np.any(np.asarray(loaded["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"]))


# --- export -----------------------------------------------------------------------

def test_bf16_export_is_the_published_directory(tmp_path):
    """Export of the imported published fixture writes its tensors back: same
    names (block_sparse_moe, w1/w3/w2), dtypes (all bf16, the router too) and bytes."""
    written = parity.bf16_export_of_published(MIXTRAL, tmp_path)
    assert written["model_type"] == "mixtral" and written["sliding_window"] is None
    assert hf_config.model_keys(written) == hf_config.model_keys(_config_json())


def test_fused_import_export_import_is_bitwise(tmp_path):
    parity.assert_import_export_import_bitwise(os.path.join(MIXTRAL, "fused"), tmp_path)


def test_export_refuses_what_mixtral_cannot_hold(tmp_path):
    src = os.path.join(MIXTRAL, "published")
    cfg = model_cfg(src)
    state = load_params(src, cfg)
    with pytest.raises(hf_config.HFConfigError, match="norm_topk_prob=True"):
        write_hf(state, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=False)),
                 str(tmp_path / "a"))
    bias = state["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"]
    state["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"] = bias.at[0, 1].set(0.5)
    with pytest.raises(ValueError, match="router_bias is nonzero but mixtral"):
        write_hf(state, cfg, str(tmp_path / "b"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A dropless checkpoint step holding the published fixture's parameters."""
    return parity.published_checkpoint(MIXTRAL, tmp_path_factory.mktemp("run"))


def test_export_hf_command_writes_mixtral(checkpoint, tmp_path):
    """export-hf reads the run's config.json (GQA without q/k norm) and writes Mixtral."""
    config = parity.export_hf_command(*checkpoint, tmp_path / "hf")
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]


def test_transformers_loads_the_export(checkpoint, tmp_path):
    """Only where torch and transformers are installed (not dropless dependencies)."""
    parity.assert_transformers_loads_export(MIXTRAL, checkpoint[0], tmp_path / "hf", "MixtralForCausalLM")
