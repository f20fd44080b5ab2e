"""export-hf and back: the written directory is the published layout transformers
wrote, and import -> export -> import gives the same bits."""

import json
import os

import numpy as np
import parity
import pytest

from dropless import cli


def test_bf16_export_is_the_published_directory(fixtures, tmp_path):
    """Export of the imported published fixture writes transformers' own tensors
    back: same names, shapes, dtypes (router float32) and bytes."""
    parity.bf16_export_of_published(fixtures, tmp_path)
    assert len(set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())) > 1


@pytest.mark.parametrize("layout", ["fused", "fp8_mtp"])
def test_import_export_import_is_bitwise(fixtures, tmp_path, layout):
    parity.assert_import_export_import_bitwise(os.path.join(fixtures, layout), tmp_path)


@pytest.fixture
def checkpoint(fixtures, tmp_path):
    """A dropless checkpoint step holding the published fixture's parameters."""
    return parity.published_checkpoint(fixtures, tmp_path / "run")


def test_export_hf_command_round_trips(checkpoint, tmp_path):
    step, state = checkpoint
    config = parity.export_hf_command(step, state, tmp_path / "hf")
    assert config["model_type"] == "deepseek_v3" and config["rope_scaling"]["type"] == "yarn"


def test_transformers_loads_the_export(fixtures, checkpoint, tmp_path):
    """Only where torch and transformers are installed (not dropless dependencies)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    step, _ = checkpoint
    out = tmp_path / "hf"
    assert cli.main(["export-hf", step, "--out", str(out), "--dtype", "float32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.from_numpy(np.load(os.path.join(fixtures, "tokens.npy"))).long()
    with torch.no_grad():
        logits = model(tokens).logits.numpy()
    np.testing.assert_array_equal(logits, np.load(os.path.join(fixtures, "logits.npy")))
