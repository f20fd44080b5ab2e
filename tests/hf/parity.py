"""Checks that the Hugging Face tests of each model family (``test_qwen3_moe.py``,
``test_mixtral.py``, DeepSeek-V3's ``test_roundtrip.py``) run alike against
their fixture directories (``tools/make_hf_fixture*.py``): ``fixture`` is one
such directory, holding ``published/``, ``fused/``, ``tokens.npy``,
``logits.npy`` and ``experts.npy``.

Each test file derives its tolerance ``bound`` in its docstring and passes it
in; nothing here picks one.
"""

import json
import os

import numpy as np
import pytest
from hf_fixture import (assert_bitwise_equal, assert_same_tensors, load_model, load_params, logits_and_experts,
                        model_cfg, read_all, rel_fro, save_checkpoint)

from dropless import cli
from dropless.config.loader import ConfigError, load_config
from dropless.hf.export import write_hf


def assert_refused(tmp_path, config: dict, words: str) -> None:
    """``config`` as a directory's config.json is refused in one line naming ``words``."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"hf_model_path={tmp_path}"])
    msg = str(e.value)
    assert "\n" not in msg and words in msg and "not supported" in msg, msg


def assert_forward_command_matches(fixture: str, layout: str, tmp_path, bound: float) -> None:
    """``dropless forward`` of ``fixture/layout`` gives transformers' float32 logits within
    relative Frobenius error ``bound``, and the same top-1 tokens."""
    out = tmp_path / "logits.npy"
    code = cli.main(["forward", f"hf_model_path={os.path.join(fixture, layout)}", "hardware=cpu",
                     "--tokens", os.path.join(fixture, "tokens.npy"), "--out", str(out)])
    assert code == 0
    logits, ref = np.load(out), np.load(os.path.join(fixture, "logits.npy"))
    assert logits.dtype == np.float32 and logits.shape == ref.shape
    assert rel_fro(logits, ref) < bound
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))


def assert_routes_as_transformers(fixture: str, layout: str, monkeypatch, bound: float) -> dict:
    """Each MoE layer of ``fixture/layout`` sends each token to the experts transformers'
    router picked (exactly), the logits within ``bound``; returns the loaded parameters."""
    model, loaded = load_model(os.path.join(fixture, layout))
    logits, experts = logits_and_experts(model, np.load(os.path.join(fixture, "tokens.npy")), monkeypatch)
    np.testing.assert_array_equal(experts, np.load(os.path.join(fixture, "experts.npy")))
    assert rel_fro(logits, np.load(os.path.join(fixture, "logits.npy"))) < bound
    return loaded


def bf16_export_of_published(fixture: str, tmp_path) -> dict:
    """Exports the imported ``fixture/published`` in bfloat16 to ``tmp_path``, in shards,
    checks the tensors are the published ones (names, dtypes, bytes) and returns the
    written config.json."""
    src = os.path.join(fixture, "published")
    cfg = model_cfg(src)
    write_hf(load_params(src, cfg), cfg, str(tmp_path), dtype="bfloat16", max_shard_bytes=40_000)
    assert_same_tensors(read_all(str(tmp_path)), read_all(src))
    return json.load(open(tmp_path / "config.json"))


def assert_import_export_import_bitwise(src: str, tmp_path) -> None:
    """``src`` imported, exported in float32 and imported again gives the same bits."""
    cfg = model_cfg(src)
    first = load_params(src, cfg)
    write_hf(first, cfg, str(tmp_path), dtype="float32")
    assert_bitwise_equal(load_params(str(tmp_path), model_cfg(str(tmp_path))), first)


def published_checkpoint(fixture: str, run) -> tuple[str, dict]:
    """(a dropless checkpoint step under the run directory ``run`` holding
    ``fixture/published``'s parameters, those parameters)."""
    src = os.path.join(fixture, "published")
    cfg = model_cfg(src)
    state = load_params(src, cfg)
    return save_checkpoint(run, cfg, state), state


def export_hf_command(step: str, state: dict, out) -> dict:
    """``dropless export-hf`` of ``step`` in float32 to ``out`` imports back bitwise as
    ``state``; returns the written config.json."""
    assert cli.main(["export-hf", step, "--out", str(out), "--dtype", "float32"]) == 0
    assert_bitwise_equal(load_params(str(out), model_cfg(str(out))), state)
    return json.load(open(out / "config.json"))


def assert_transformers_loads_export(fixture: str, step: str, out, architecture: str) -> None:
    """transformers loads the float32 export of ``step`` as ``architecture`` with no
    missing, unexpected or mismatched tensor, and its logits are the fixture's bit
    for bit. Only where torch and transformers are installed (not dropless dependencies)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert cli.main(["export-hf", step, "--out", str(out), "--dtype", "float32"]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(model).__name__ == architecture
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.load(os.path.join(fixture, "tokens.npy"))).long()).logits.numpy()
    np.testing.assert_array_equal(logits, np.load(os.path.join(fixture, "logits.npy")))
