"""The run directory: config.json written once; a changed config on resume is
refused, or (allowed) printed and logged; free keys change without asking.
"""

import json
import os

import pytest

from dropless.config.loader import ConfigError
from dropless.train import run_dir as run_dir_lib

BASE = {"model": {"vocab_size": 32, "mla": {"num_heads": 2}}, "train": {"steps": 10, "log_period": 1}}


def _with(**changes):
    cfg = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        section, key = path.split("__")
        cfg[section][key] = value
    return cfg


def test_config_is_written_once_and_changes_are_logged(tmp_path):
    run_dir = run_dir_lib.make_run_dir(str(tmp_path), "r")
    assert run_dir_lib.record_config(run_dir, BASE, allow_change=False, primary=True) == {}
    written = (tmp_path / "r" / "config.json").read_text()
    assert run_dir_lib.record_config(run_dir, BASE, allow_change=False, primary=True) == {}

    with pytest.raises(ConfigError, match=r"another config \(steps 10 -> 20\)"):
        run_dir_lib.record_config(run_dir, _with(train__steps=20), allow_change=False, primary=True)
    said = []
    diffs = run_dir_lib.record_config(run_dir, _with(train__steps=20), allow_change=True,
                                      primary=True, say=said.append)
    assert diffs == {"train.steps": [10, 20]} and "steps 10 -> 20" in said[0]
    assert (tmp_path / "r" / "config.json").read_text() == written  # never overwritten
    logged = [json.loads(x) for x in (tmp_path / "r" / "config_changes.jsonl").read_text().splitlines()]
    assert [x["changes"] for x in logged] == [{"train.steps": [10, 20]}]
    # The next resume compares against the config with the logged change applied.
    assert run_dir_lib.record_config(run_dir, _with(train__steps=20), allow_change=False, primary=True) == {}
    with pytest.raises(ConfigError, match="steps 20 -> 10"):
        run_dir_lib.record_config(run_dir, BASE, allow_change=False, primary=True)


def test_keys_that_change_no_numbers_are_free(tmp_path):
    run_dir = run_dir_lib.make_run_dir(str(tmp_path), "r")
    run_dir_lib.record_config(run_dir, BASE, allow_change=False, primary=True)
    assert run_dir_lib.record_config(run_dir, _with(train__log_period=7), allow_change=False,
                                     primary=True) == {}
    assert run_dir_lib.record_config(run_dir, _with(train__checkpoint_device_snapshot=True),
                                     allow_change=False, primary=True) == {}
    # Where the starting weights came from does not matter once the run has its own checkpoints.
    assert run_dir_lib.record_config(run_dir, _with(train__hf_model_path="/elsewhere"),
                                     allow_change=False, primary=True) == {}
    with pytest.raises(ConfigError, match="num_heads 2 -> 4"):  # a nested section's key
        cfg = _with()
        cfg["model"]["mla"]["num_heads"] = 4
        run_dir_lib.record_config(run_dir, cfg, allow_change=False, primary=True)


def test_export_reads_the_config_the_run_has_now(tmp_path):
    """``export-hf`` takes the model keys from config.json plus the changes logged on a
    resume that allowed them, not the first start's alone."""
    from dropless.config.loader import load_config
    from dropless.train import export_hf

    def sections(*overrides):
        c = load_config(None, ["model_name=deepseek3-tiny", *overrides], environ={}).config
        return run_dir_lib.sections_dict(c.model(), c.train(), c.mesh())

    run_dir = run_dir_lib.make_run_dir(str(tmp_path), "r")
    run_dir_lib.record_config(run_dir, sections(), allow_change=False, primary=True)
    run_dir_lib.record_config(run_dir, sections("routed_scaling_factor=3.5"), allow_change=True,
                              primary=True, say=lambda *_: None)
    model = export_hf.model_config_of_run(os.path.join(run_dir, "checkpoints", "20"))
    assert model.moe.routed_scaling_factor == 3.5
