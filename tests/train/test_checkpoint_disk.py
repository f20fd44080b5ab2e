"""Checkpoint disk space and failed saves.

The pre-flight (``checkpoint.plan_disk``) refuses a run whose first save
cannot fit and warns when a later one cannot (Orbax writes the new save before
deleting the oldest: ``keep + 1`` on disk at once). A save that fails (here:
``OSError(28)`` raised by Orbax's save, or by its background write when waited
for) ends the run with one line naming the step, the cause and the intact
checkpoints, which stay untouched. The disk is faked by replacing
``shutil.disk_usage``; a save fails by replacing a ``CheckpointManager`` method.
"""

import collections
import errno
import io
import json
import logging
import os
import shutil

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from rich.console import Console

from dropless import cli
from dropless.config.sections import MeshConfig
from dropless.train import checkpoint as ckpt_lib
from dropless.train import loop
from dropless.train.loop import run_training

GiB = 2**30
_Usage = collections.namedtuple("_Usage", "total used free")


def _fake_disk(monkeypatch, free: int):
    """Every filesystem reports ``free`` bytes free."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10 * free + 1, 0, free))


def _step_dir(directory, step, *, size=None):
    """A step directory; with ``size``, sealed with a manifest recording one file of that many bytes."""
    path = os.path.join(directory, str(step))
    os.makedirs(path)
    if size is not None:
        with open(os.path.join(path, ckpt_lib.MANIFEST), "w") as f:
            json.dump({"version": 1, "files": {"model/data": [size, 0]}}, f)


def test_save_steps():
    assert ckpt_lib.save_steps(0, 61, 20) == [20, 40, 60, 61]
    assert ckpt_lib.save_steps(0, 60, 20) == [20, 40, 60]
    assert ckpt_lib.save_steps(40, 61, 20) == [60, 61]
    assert ckpt_lib.save_steps(0, 5, 1000) == [5]
    assert ckpt_lib.save_steps(61, 61, 20) == []


def test_free_space_is_measured_on_the_nearest_existing_parent(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: asked.append(path) or _Usage(9, 0, 7))
    assert ckpt_lib.free_bytes(str(tmp_path / "runs" / "r" / "checkpoints")) == (7, str(tmp_path))
    assert asked == [str(tmp_path)]


def test_plan(tmp_path, monkeypatch):
    """The user's case: 41 GiB saves at 20, 40, 60, 61 with 3 kept need 4 saves' room at once."""
    size = int(41.12 * GiB)
    plan = lambda **kw: ckpt_lib.plan_disk(  # noqa: E731
        str(tmp_path / "ckpt"), **{"uncompressed_bytes": size, "keep": 3, "period": 20, "start": 0,
                                   "steps": 61, **kw})
    _fake_disk(monkeypatch, 40 * GiB)
    error = plan().error()
    assert error and "40.00 GiB free" in error and "one save of up to 41.12 GiB" in error
    assert "base_output_directory" in error and plan().warning() is None

    _fake_disk(monkeypatch, 64 * GiB)  # one fits, not four
    assert plan().error() is None and plan().at_once == 4 and plan().fits == 1
    warning = plan().warning()
    for needle in ("64.00 GiB free", "holds 1 save(s) of up to 41.12 GiB", "room for 4 more",
                   "max_num_checkpoints_to_keep=3 kept + 1 being written", "the save at step 40 will fail",
                   "lower max_num_checkpoints_to_keep", "base_output_directory", "checkpoint_period"):
        assert needle in warning, (needle, warning)
    assert plan(keep=1).warning() and "room for 2 more" in plan(keep=1).warning()
    assert plan(steps=30).warning() and "room for 2 more" in plan(steps=30).warning()  # saves 20, 30
    assert plan(steps=19).warning() is None  # one save: the last step

    _fake_disk(monkeypatch, 170 * GiB)  # four fit
    assert plan().error() is None and plan().warning() is None
    assert plan(keep=0, steps=200).warning() and "room for 10 more" in plan(keep=0, steps=200).warning()


def test_plan_counts_existing_checkpoints_on_resume(tmp_path, monkeypatch):
    """Two sealed checkpoints of 30 GiB measured, keep 3: one more save at once, at its measured size."""
    directory = str(tmp_path / "ckpt")
    _step_dir(directory, 20, size=30 * GiB)
    _step_dir(directory, 40, size=30 * GiB)
    _fake_disk(monkeypatch, 35 * GiB)
    plan = ckpt_lib.plan_disk(directory, uncompressed_bytes=int(41.12 * GiB), keep=3, period=20, start=40,
                              steps=101)
    assert (plan.existing, plan.per_save, plan.measured, plan.saves) == (2, 30 * GiB, True, (60, 80, 100, 101))
    assert plan.at_once == 2 and plan.fits == 1  # 60 on top of 20, 40; 80 on top of 20, 40, 60
    warning = plan.warning()
    assert "30.00 GiB (measured on the newest checkpoint)" in warning and "2 already there" in warning
    assert "the save at step 80 will fail" in warning
    fresh = ckpt_lib.plan_disk(directory, uncompressed_bytes=GiB, keep=3, period=20, start=0, steps=20,
                               fresh=True)
    assert (fresh.existing, fresh.measured) == (0, False)


def test_train_refuses_a_disk_without_room_for_one_save(capsys, tmp_path, monkeypatch):
    """One line, exit 2, before any step (no metrics written)."""
    _fake_disk(monkeypatch, 1000)
    code = cli.main(["train", "model_name=deepseek3-tiny", "hardware=auto", "steps=2",
                     f"base_output_directory={tmp_path / 'runs'}", "run_name=r"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "cannot hold one save of up to" in lines[0] and "1000 bytes free" in lines[0]
    assert not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()


def test_dry_run_checks_the_checkpoint_disk(capsys, tmp_path, monkeypatch):
    _fake_disk(monkeypatch, 1000)
    args = ["train", "--dry-run", "model_name=deepseek3-tiny", f"base_output_directory={tmp_path}",
            "run_name=r"]
    assert cli.main(args) == 2
    assert "cannot hold one save" in capsys.readouterr().err
    assert cli.main([*args, "enable_checkpointing=false"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--device", "h200"]) == 0  # another machine: said, not refused
    assert "cannot hold one save" in capsys.readouterr().out


class _Stop(Exception):
    pass


def test_train_warns_when_not_every_save_fits(small_model, make_train, tmp_path, monkeypatch):
    """Room for one save of the small model but not keep + 1: one warning line, then training starts."""
    seen = []
    real = ckpt_lib.plan_disk

    def plan_disk(directory, **kw):  # room for 1.5 of the saves the trainer plans with
        _fake_disk(monkeypatch, int(1.5 * kw["uncompressed_bytes"]))
        seen.append(real(directory, **kw))
        return seen[-1]

    monkeypatch.setattr(ckpt_lib, "plan_disk", plan_disk)
    monkeypatch.setattr(loop, "_train_steps", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    train = make_train(tmp_path, steps=40, checkpoint_period=10, max_num_checkpoints_to_keep=2)
    out = io.StringIO()
    with pytest.raises(_Stop):
        run_training(small_model, train, MeshConfig(), console=Console(file=out, width=80))
    assert len(seen) == 1 and seen[0].per_save > 0 and not seen[0].measured
    lines = [line for line in out.getvalue().splitlines() if line.startswith("checkpoint:")]
    assert len(lines) == 1, out.getvalue()
    assert "holds 1 save(s)" in lines[0] and "room for 3 more" in lines[0]
    assert "max_num_checkpoints_to_keep=2" in lines[0] and "the save at step 20 will fail" in lines[0]


def _enospc():
    return OSError(errno.ENOSPC, "No space left on device")


def _tiny_state(step):
    return {"params": {"w": jnp.ones((4, 4), jnp.bfloat16)}, "router_bias": jnp.zeros(2),
            "opt_state": {"mu": jnp.zeros((4, 4))}, "step": jnp.asarray(step), "skipped_steps": jnp.asarray(0)}


def _run_until_the_save_fails(small_model, make_train, tmp_path):
    train = make_train(tmp_path, steps=6, checkpoint_period=2, max_num_checkpoints_to_keep=0)
    with pytest.raises(ckpt_lib.CheckpointSaveError) as info:
        run_training(small_model, train, MeshConfig(), console=Console(file=io.StringIO()))
    return info.value, tmp_path / "run" / "checkpoints"


def _assert_reported(e, directory):
    assert e.step == 4 and e.intact == [2]
    text = str(e)
    for needle in ("checkpoint save at step 4 failed", "No space left on device (errno 28)",
                   "GiB free on the filesystem of", "intact checkpoints: step 2",
                   "the same command resumes from step 2", "max_num_checkpoints_to_keep"):
        assert needle in text, (needle, text)
    assert "\n" not in text
    ckpt_lib.verify_manifest(str(directory / "2"))  # the earlier checkpoint: intact, every byte


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_that_raises(tmp_path, monkeypatch, async_save):
    """Orbax's save itself raising ENOSPC for step 4: reported, step 2 kept, the checkpointer closed."""
    real = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 4:
            raise _enospc()
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    directory = tmp_path / "checkpoints"
    ckpt = ckpt_lib.Checkpointer(str(directory), period=2, async_save=async_save, per_save_bytes=3 * GiB)
    assert ckpt.save(2, _tiny_state(2))
    with pytest.raises(ckpt_lib.CheckpointSaveError) as info:
        ckpt.save(4, _tiny_state(4))
    _assert_reported(info.value, directory)
    assert "a save writes up to 3.00 GiB" in str(info.value)
    ckpt.close()  # nothing more to report
    assert ckpt_lib.step_dirs(str(directory)) == [2]


def test_a_failed_background_write_ends_the_run(small_model, make_train, tmp_path, monkeypatch):
    """Step 4's background write fails (seen when it is waited for): its partial files are removed."""
    real = ocp.CheckpointManager.wait_until_finished
    failed = []

    def wait_until_finished(self):
        real(self)
        step4 = os.path.join(str(self.directory), "4")
        if not failed and os.path.isdir(step4):  # as if the write had stopped before the rename
            failed.append(step4 + ckpt_lib.TMP_SUFFIX)
            os.rename(step4, failed[0])
            raise ValueError("RESOURCE_EXHAUSTED: Error writing ... Failed to write 1943588864 bytes to file 60: "
                             "No space left on device [source locations='x.cc:1'] [os_error_code='28']")

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait_until_finished)
    e, directory = _run_until_the_save_fails(small_model, make_train, tmp_path)
    _assert_reported(e, directory)
    assert "its partial files were removed" in str(e) and failed and not os.path.exists(failed[0])
    assert ckpt_lib.step_dirs(str(directory)) == [2]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows[-1]["step"] <= 6


def test_cli_reports_a_failed_save_in_one_line(capsys, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise ckpt_lib.CheckpointSaveError("checkpoint save at step 60 failed: No space left on device "
                                           "(errno 28); intact checkpoints: step 20, 40", 60, [20, 40])

    monkeypatch.setattr(loop, "run_training", fail)
    code = cli.main(["train", "model_name=deepseek3-tiny", "hardware=auto", "steps=2",
                     f"base_output_directory={tmp_path / 'runs'}", "run_name=r"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and lines == ["dropless: error: checkpoint save at step 60 failed: No space left on "
                                   "device (errno 28); intact checkpoints: step 20, 40"]


def test_orbax_errors_are_logged_without_tracebacks_unless_debug(capsys):
    from absl import logging as absl_logging

    assert cli.main(["config", "run_name=x"]) == 0
    absl_logger = absl_logging.get_absl_logger()  # absl's own logger class (it finds Orbax's frames)
    assert isinstance(absl_logger, absl_logging.ABSLLogger) and cli._QUIET_ORBAX in absl_logger.filters
    quiet = cli._NoLibraryTracebacks()
    try:
        raise ValueError("disk full")
    except ValueError:
        import sys

        exc_info = sys.exc_info()
    orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "future.py")
    record = logging.LogRecord("absl", logging.ERROR, orbax_file, 1, "write failed", (), exc_info)
    assert quiet.filter(record) and record.exc_info is None
    other = logging.LogRecord("absl", logging.ERROR, "/x/mine.py", 1, "failed", (), exc_info)
    assert quiet.filter(other) and other.exc_info is exc_info

