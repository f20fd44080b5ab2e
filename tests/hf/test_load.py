"""Checks of ``hf.load`` that run before anything is read: every tensor missing,
unexpected, of the wrong shape or dtype is a one-line error naming it."""

import json
import os

import numpy as np
import pytest

from dropless.config.loader import load_config
from dropless.hf import load
from hf_fixture import read_all, write_variant


def _model(path, *extra):
    return load_config(None, [f"hf_model_path={path}", *extra]).config.model()


def _published(fixtures):
    return os.path.join(fixtures, "published")


def _error(path, cfg) -> str:
    with pytest.raises(load.HFCheckpointError) as e:
        load.check(path, cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_fixture_layouts_pass_the_checks(fixtures):
    for name, layout in (("published", "published"), ("fused", "fused"), ("fp8_mtp", "published")):
        path = os.path.join(fixtures, name)
        assert load.check(path, _model(path)) == layout


def test_missing_tensor_is_named(fixtures, tmp_path):
    src = _published(fixtures)
    tensors = read_all(src)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    path = write_variant(src, str(tmp_path), tensors)
    assert "missing tensor model.layers.2.mlp.experts.5.up_proj.weight [16, 32]" in _error(path, _model(path))


def test_unexpected_tensor_is_named(fixtures, tmp_path):
    src = _published(fixtures)
    tensors = read_all(src)
    tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = np.zeros((16, 32), np.float32)
    path = write_variant(src, str(tmp_path), tensors)
    assert "unexpected tensor model.layers.1.mlp.experts.8.up_proj.weight" in _error(path, _model(path))


def test_wrong_shape_is_named(fixtures, tmp_path):
    src = _published(fixtures)
    tensors = read_all(src)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((32, 15), np.float32)
    path = write_variant(src, str(tmp_path), tensors)
    msg = _error(path, _model(path))
    assert "model.layers.0.self_attn.kv_b_proj.weight has shape [32, 15], expected [32, 16]" in msg


def test_integer_tensor_is_refused(fixtures, tmp_path):
    src = _published(fixtures)
    tensors = read_all(src)
    tensors["model.norm.weight"] = np.ones(32, np.int32)
    path = write_variant(src, str(tmp_path), tensors)
    assert "model.norm.weight has dtype I32" in _error(path, _model(path))


def test_mtp_layers_are_loaded_or_skipped_as_asked(fixtures):
    path = os.path.join(fixtures, "fp8_mtp")
    mapping = load._Plan(path, _model(path)).mapping
    assert any(leaf.path[:2] == ("params", "mtp") for leaf in mapping.leaves)
    plan = load._Plan(path, _model(path, "mtp_num_layers=0"))  # MTP tensors skipped, not unexpected
    assert not any(leaf.path[:2] == ("params", "mtp") for leaf in plan.mapping.leaves)


def test_mtp_layer_missing_suggests_mtp_num_layers_0(fixtures, tmp_path):
    src = _published(fixtures)
    config = json.load(open(os.path.join(src, "config.json")))
    config["num_nextn_predict_layers"] = 1
    path = write_variant(src, str(tmp_path), read_all(src), config)
    msg = _error(path, _model(path))
    assert "model.layers.3." in msg and "mtp_num_layers=0" in msg


def test_mtp_copy_of_the_head_must_equal_it(fixtures, tmp_path):
    """fp8_mtp holds FP8 tensors, which the numpy writer cannot write: build an
    MTP variant of the bf16 published directory instead."""
    src = _published(fixtures)
    tensors = read_all(src)
    mtp = read_all(os.path.join(fixtures, "fp8_mtp"))
    for name, value in mtp.items():
        if name.startswith("model.layers.3.") and value.dtype.itemsize > 1 and "scale_inv" not in name:
            tensors[name] = value
    for name in list(mtp):  # FP8 weights of the MTP layer: any bf16 values of the right shape
        if name.startswith("model.layers.3.") and mtp[name].dtype.itemsize == 1:
            tensors[name] = np.zeros(mtp[name].shape, np.float32)
    config = json.load(open(os.path.join(src, "config.json")))
    config["num_nextn_predict_layers"] = 1
    path = write_variant(src, str(tmp_path / "ok"), tensors, config)
    load.check(path, _model(path))
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"] + np.float32(1)
    path = write_variant(src, str(tmp_path / "bad"), tensors, config)
    assert "model.layers.3.shared_head.head.weight differs from lm_head.weight" in _error(path, _model(path))


def test_check_then_load_plans_the_directory_once_unless_it_changes(fixtures, tmp_path, monkeypatch):
    """The trainer checks at start and loads later: one plan (headers, mapping, checks)
    serves both, and a file changed in between makes a new one."""
    src = _published(fixtures)
    path = write_variant(src, str(tmp_path), read_all(src))
    cfg = _model(path)
    made = []
    real = load._Plan
    monkeypatch.setattr(load, "_Plan", lambda *a: made.append(a) or real(*a))
    load._cached_plan.cache_clear()
    load.check(path, cfg)
    load.check(path, cfg)
    assert len(made) == 1
    tensors = read_all(path)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    write_variant(src, str(tmp_path), tensors)  # the same directory, rewritten
    assert "missing tensor model.layers.2.mlp.experts.5.up_proj.weight" in _error(path, cfg)
    assert len(made) == 2
