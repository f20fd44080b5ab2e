"""Qwen3-MoE through hf_model_path, forward and export-hf, against transformers.

The fixture (``tools/make_hf_fixture_qwen3.py``, ``fixtures/qwen3_moe``) is a
tiny random ``Qwen3MoeForCausalLM`` made by transformers in float32: GQA 4
query / 2 kv heads of head_dim 16 (not hidden 32 / 4 heads, as the 30B's 128
is not 2048 / 32), q/k RMSNorm, softmax top-2 of 8 experts renormalised
(``norm_topk_prob``), no shared expert, one ``mlp_only_layers`` dense layer,
untied embeddings; its logits and routed experts, in the published
(per-expert, sharded) and transformers 5 (fused) layouts.

Tolerance of the parity: both sides run float32 on the same weights
(bf16-representable, so the bf16 files are exact) and differ only in the
order of float32 sums (matmul blocking, softmax and RMSNorm reductions), a
few 2^-24 relative per op over <= 64-term sums; through 3 layers that is
~1e-6 relative Frobenius error in the logits (measured 6.2e-7). The bound is
the issue's 1e-4. Top-1 tokens and routed experts must agree exactly: the
smallest router margin (k-th minus (k+1)-th probability, ``meta.json``) is
1.3e-3, far above that error.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import parity
import pytest
from hf_fixture import QWEN3, load_params, model_cfg, read_all

from dropless.config import hf_config
from dropless.config.loader import ConfigError, load_config
from dropless.hf.export import write_hf
from dropless.train import loop

LAYOUTS = ("published", "fused")
BOUND = 1e-4  # relative Frobenius error of the logits, derived above


def _config_json(layout="published") -> dict:
    return hf_config.read_config_json(os.path.join(QWEN3, layout))


# --- config.json ------------------------------------------------------------------

def test_both_layouts_give_the_qwen3_model_keys():
    """published (rope_theta, num_experts) and transformers 5 (rope_parameters,
    num_local_experts) give the same keys: the fixture's shapes and Qwen3's structure."""
    pub, fused = (hf_config.model_keys(_config_json(layout)) for layout in LAYOUTS)
    assert pub == fused
    hf = json.load(open(os.path.join(QWEN3, "meta.json")))["hf_config"]
    assert (pub["num_query_heads"], pub["num_kv_heads"], pub["head_dim"]) == (4, 2, hf["head_dim"])
    assert (pub["num_experts"], pub["num_experts_per_tok"], pub["first_num_dense_layers"]) == (8, 2, 1)
    assert (pub["decoder_block"], pub["attention_type"], pub["use_qk_norm"]) == ("qwen3_moe", "gqa", True)
    assert pub["norm_topk_prob"] and pub["routed_score_func"] == "softmax" and pub["rope_max_timescale"] == 1e6


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "'yarn'"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True"),
    ({"num_experts": 0}, "num_experts=0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_scaling": {"type": "default", "partial_rotary_factor": 0.25}}, "partial_rotary_factor=0.25"),
])
def test_what_dropless_cannot_compute_is_refused_naming_the_key(tmp_path, change, words):
    parity.assert_refused(tmp_path, {**_config_json(), **change}, words)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_written_config_json_reads_back_as_the_preset(preset):
    """qwen3_moe_config is the inverse of qwen3_moe_keys on the published shapes."""
    cfg = load_config(None, [f"model_name={preset}"]).config
    keys = hf_config.model_keys(hf_config.qwen3_moe_config(cfg.model(), torch_dtype="bfloat16"))
    assert keys == {k: getattr(cfg, k) for k in keys}


def test_a_key_given_against_the_directory_is_a_contradiction():
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"hf_model_path={os.path.join(QWEN3, 'published')}", "num_kv_heads=4"])
    assert "contradicts" in str(e.value) and "num_kv_heads=4" in str(e.value)
    # A Qwen3 preset's keys give way to the directory's (no contradiction).
    cfg = load_config(None, [f"hf_model_path={os.path.join(QWEN3, 'published')}",
                             "model_name=qwen3-moe-tiny"]).config
    assert (cfg.emb_dim, cfg.head_dim, cfg.first_num_dense_layers) == (32, 16, 1)


# --- parity -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_command_matches_transformers_logits(tmp_path, layout):
    parity.assert_forward_command_matches(QWEN3, layout, tmp_path, bound=BOUND)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_routed_experts_match_transformers(monkeypatch, layout):
    """Each MoE layer sends each token to the experts transformers' router picked."""
    loaded = parity.assert_routes_as_transformers(QWEN3, layout, monkeypatch, bound=BOUND)
    # Qwen3 has no routing bias: the state dropless keeps for one is zeros.
    assert not np.any(np.asarray(loaded["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"]))


# --- export -----------------------------------------------------------------------

def test_bf16_export_is_the_published_directory(tmp_path):
    """Export of the imported published fixture writes transformers' own tensors
    back: same names, dtypes (all bf16, the router too) and bytes."""
    written = parity.bf16_export_of_published(QWEN3, tmp_path)
    assert hf_config.model_keys(written) == hf_config.model_keys(_config_json())


def test_fused_import_export_import_is_bitwise(tmp_path):
    parity.assert_import_export_import_bitwise(os.path.join(QWEN3, "fused"), tmp_path)


def test_export_refuses_what_qwen3_cannot_hold(tmp_path):
    src = os.path.join(QWEN3, "published")
    cfg = model_cfg(src)
    state = load_params(src, cfg)
    with pytest.raises(hf_config.HFConfigError, match="routed_score_func='softmax'"):
        write_hf(state, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, routed_score_func="sigmoid")),
                 str(tmp_path / "a"))
    bias = state["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"]
    state["router_bias"]["moe_layers"]["layers"]["moe"]["router_bias"] = bias.at[0, 1].set(0.5)
    with pytest.raises(ValueError, match="router_bias is nonzero"):
        write_hf(state, cfg, str(tmp_path / "b"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A dropless checkpoint step holding the published fixture's parameters."""
    return parity.published_checkpoint(QWEN3, tmp_path_factory.mktemp("run"))


def test_export_hf_command_writes_qwen3(checkpoint, tmp_path):
    """export-hf reads the run's config.json (GQA section included) and writes Qwen3-MoE."""
    config = parity.export_hf_command(*checkpoint, tmp_path / "hf")
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0]


def test_transformers_loads_the_export(checkpoint, tmp_path):
    """Only where torch and transformers are installed (not dropless dependencies)."""
    parity.assert_transformers_loads_export(QWEN3, checkpoint[0], tmp_path / "hf", "Qwen3MoeForCausalLM")


# --- fine-tuning ------------------------------------------------------------------

def test_fine_tuning_from_qwen3_starts_from_its_weights_and_loss_falls(tmp_path):
    cfg = load_config(None, [
        f"hf_model_path={os.path.join(QWEN3, 'published')}", "hardware=cpu", "steps=6",
        "per_device_batch_size=8", "max_target_length=24", "learning_rate=3e-3",
        "warmup_steps_fraction=0", "enable_checkpointing=false", "enable_tensorboard=false",
        f"base_output_directory={tmp_path}", "run_name=ft", "remat_policy=none"]).config
    built = loop.build(cfg.model(), cfg.train(), cfg.mesh())
    head = read_all(os.path.join(QWEN3, "published"))["lm_head.weight"]
    np.testing.assert_array_equal(np.asarray(jax.device_get(built.state["params"]["head"]["kernel"])),
                                  head.astype(np.float32).T)
    # One batch, six AdamW steps: the loss on it must fall clearly (the batch-to-batch
    # spread of this random-weight model's loss, ~0.2 nats, would hide a trend over
    # fresh batches in so few steps).
    state, losses, batch = built.state, [], next(built.batches)
    for _ in range(6):
        state, metrics = built.step_fn(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.5, losses
