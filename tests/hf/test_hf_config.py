"""config.json -> dropless keys (``config.hf_config``) and back, and the loader's
contradiction rule for hf_model_path."""

import json
import os

import pytest

from dropless.config import hf_config
from dropless.config.loader import ConfigError, load_config


def _keys(path):
    return hf_config.model_keys(hf_config.read_config_json(path))


def test_both_layouts_give_the_same_keys(fixtures):
    """published (rope_scaling + rope_theta) and transformers 5 (rope_parameters) agree."""
    pub, fused = _keys(os.path.join(fixtures, "published")), _keys(os.path.join(fixtures, "fused"))
    assert pub == fused
    meta = json.load(open(os.path.join(fixtures, "meta.json")))
    rope = meta["rope_parameters"]
    assert pub["emb_dim"] == meta["hf_config"]["hidden_size"]
    assert pub["q_lora_rank"] == meta["hf_config"]["q_lora_rank"]
    assert (pub["rope_factor"], pub["mscale"], pub["mscale_all_dim"]) == (
        rope["factor"], rope["mscale"], rope["mscale_all_dim"])
    assert pub["routed_bias"] and pub["routed_score_func"] == "sigmoid"


def test_hf_model_path_sets_model_keys(fixtures):
    path = os.path.join(fixtures, "fp8_mtp")
    cfg = load_config(None, [f"hf_model_path={path}"]).config
    assert (cfg.emb_dim, cfg.mlp_dim, cfg.num_experts, cfg.mtp_num_layers) == (32, 160, 8, 1)
    # Agreeing explicit values and a lower MTP depth are fine.
    cfg = load_config(None, [f"hf_model_path={path}", "emb_dim=32", "mtp_num_layers=0"]).config
    assert cfg.mtp_num_layers == 0


@pytest.mark.parametrize("override, words", [
    ("emb_dim=64", ["emb_dim=64", "32"]),
    ("mtp_num_layers=2", ["mtp_num_layers=2", "gives 1"]),
    ("rope_factor=8", ["rope_factor=8", "4.0"]),
])
def test_contradicting_key_is_one_line_error(fixtures, override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"hf_model_path={os.path.join(fixtures, 'fp8_mtp')}", override])
    msg = str(e.value)
    assert "\n" not in msg and "contradicts" in msg and all(w in msg for w in words), msg


def test_hf_model_path_and_load_parameters_path_contradict(fixtures):
    with pytest.raises(ConfigError, match="hf_model_path"):
        load_config(None, [f"hf_model_path={os.path.join(fixtures, 'published')}",
                           "load_parameters_path=/tmp/x"])


@pytest.mark.parametrize("change, words", [
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05"),
])
def test_unsupported_config_is_named(fixtures, tmp_path, change, words):
    cfg = json.load(open(os.path.join(fixtures, "published", "config.json")))
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"hf_model_path={tmp_path}"])


@pytest.mark.parametrize("layout", ["published", "fused"])
@pytest.mark.parametrize("rope_type, where", [
    ("default", "rope"), ("yarn", "rope"), ("default", "top"), ("yarn", "top")])
def test_partial_rotary_factor_is_refused_for_every_rope_type(fixtures, tmp_path, capsys, layout,
                                                              rope_type, where):
    """DeepSeek-V3's default RoPE too (it returned before the check), in the RoPE dict
    of either layout or at the top level of config.json: one line, exit code 2."""
    from dropless import cli

    cfg = json.load(open(os.path.join(fixtures, layout, "config.json")))
    rope = cfg["rope_scaling" if layout == "published" else "rope_parameters"]
    if rope_type == "default":
        rope = {"type": "default"} if layout == "published" else {"rope_type": "default", "rope_theta": 1e4}
        cfg["rope_scaling" if layout == "published" else "rope_parameters"] = rope
    (rope if where == "rope" else cfg)["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code = cli.main(["config", f"hf_model_path={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "partial_rotary_factor=0.5 is not supported" in err and "\n" not in err, err
    cfg["partial_rotary_factor"] = 1.0  # the value transformers writes by default: accepted
    (rope if where == "rope" else cfg)["partial_rotary_factor"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert hf_config.model_keys(hf_config.read_config_json(str(tmp_path)))["qk_rope_head_dim"] == 8


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(None, [f"hf_model_path={tmp_path / 'nope'}"])


def test_yarn_without_mscale_all_dim_matches_transformers():
    """transformers: cos/sin x mscale(factor, 1), softmax scale untouched -> our
    mscale=1 (amplitude mscale(f,1)/mscale(f,0)) and mscale_all_dim=0 (scale x 1)."""
    keys = hf_config._rope_keys({"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 16},
                                 "rope_theta": 500.0})
    assert (keys["mscale"], keys["mscale_all_dim"], keys["rope_max_timescale"]) == (1.0, 0.0, 500.0)


def test_export_config_reads_back_to_the_same_keys(fixtures):
    """deepseek_v3_config is the inverse of deepseek_v3_keys on a model section."""
    resolved = load_config(None, [f"hf_model_path={os.path.join(fixtures, 'fp8_mtp')}"])
    written = hf_config.deepseek_v3_config(resolved.config.model(), torch_dtype="float32")
    assert hf_config.model_keys(written) == _keys(os.path.join(fixtures, "fp8_mtp"))
