"""export-hf and back: the written directory is the published layout transformers
wrote, and import -> export -> import gives the same bits."""

import dataclasses
import json
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from hf_fixture import assert_bitwise_equal, assert_same_tensors, load_params, model_cfg, read_all

from dropless import cli
from dropless.hf.export import write_hf
from dropless.train.checkpoint import write_manifest


def test_bf16_export_is_the_published_directory(fixtures, tmp_path):
    """Export of the imported published fixture writes transformers' own tensors
    back: same names, shapes, dtypes (router float32) and bytes."""
    src = os.path.join(fixtures, "published")
    cfg = model_cfg(src)
    write_hf(load_params(src, cfg), cfg, str(tmp_path), dtype="bfloat16", max_shard_bytes=40_000)
    assert_same_tensors(read_all(str(tmp_path)), read_all(src))
    assert len(set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())) > 1


@pytest.mark.parametrize("layout", ["fused", "fp8_mtp"])
def test_import_export_import_is_bitwise(fixtures, tmp_path, layout):
    src = os.path.join(fixtures, layout)
    cfg = model_cfg(src)
    first = load_params(src, cfg)
    write_hf(first, cfg, str(tmp_path), dtype="float32")
    assert_bitwise_equal(load_params(str(tmp_path), model_cfg(str(tmp_path))), first)


@pytest.fixture
def checkpoint(fixtures, tmp_path):
    """A dropless checkpoint step holding the published fixture's parameters."""
    src = os.path.join(fixtures, "published")
    cfg = model_cfg(src)
    state = load_params(src, cfg)
    run = tmp_path / "run"
    step = run / "checkpoints" / "0"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(str(step / "model"), state)
    write_manifest(str(step))
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg)}))
    return str(step), cfg, state


def test_export_hf_command_round_trips(checkpoint, tmp_path):
    step, cfg, state = checkpoint
    out = tmp_path / "hf"
    assert cli.main(["export-hf", step, "--out", str(out), "--dtype", "float32"]) == 0
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == "deepseek_v3" and config["rope_scaling"]["type"] == "yarn"
    assert_bitwise_equal(load_params(str(out), model_cfg(str(out))), state)


def test_transformers_loads_the_export(fixtures, checkpoint, tmp_path):
    """Only where torch and transformers are installed (not dropless dependencies)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    step, _, _ = checkpoint
    out = tmp_path / "hf"
    assert cli.main(["export-hf", step, "--out", str(out), "--dtype", "float32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.from_numpy(np.load(os.path.join(fixtures, "tokens.npy"))).long()
    with torch.no_grad():
        logits = model(tokens).logits.numpy()
    np.testing.assert_array_equal(logits, np.load(os.path.join(fixtures, "logits.npy")))
