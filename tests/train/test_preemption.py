"""SIGTERM during ``dropless train`` (a scheduler's preemption, ``train.preemption``):
the step in progress is finished, saved and its save written, one line names
the checkpoint, exit code 143; the same command resumes from it. The SIGTERM
handler is in place only during the steps.

The signal is real (``os.kill`` of this process), sent from inside the step
function before the step's call; the handler runs at once in the main thread,
so the step being dispatched is the one saved. The same small model as
``test_interrupt`` keeps each run to seconds.

The multi-process path (JAX's preemption sync point) is checked here for its
wiring (which counter it asks about, that no Python handler replaces JAX's);
``tests/parallel/test_multiprocess_preemption.py`` sends a real SIGTERM to one
of two processes (``DROPLESS_SLOW=1``: it takes longer than these tests' budget).
"""

import json
import os
import signal
import time

import jax
import pytest
from jax.experimental import multihost_utils

from dropless import cli
from dropless.config.sections import TrainConfig
from dropless.train import checkpoint as ckpt_lib
from dropless.train import loop, preemption
from test_interrupt import SMALL, before_call


def _sigterm_at_call(monkeypatch, n: int):
    """Send this process SIGTERM just before the ``n``-th call of the train step."""
    before_call(monkeypatch, n, lambda: os.kill(os.getpid(), signal.SIGTERM))


@pytest.fixture
def sentinel_handler():
    """A SIGTERM handler of the caller's, which a run must leave in place."""
    def handler(signum, frame):
        raise AssertionError("the caller's SIGTERM handler ran during the steps")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def _steps(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def test_sigterm_saves_the_step_in_progress_and_the_same_command_resumes(
        capsys, tmp_path, monkeypatch, sentinel_handler):
    args = ["train", *SMALL, "steps=8", "checkpoint_period=4", f"base_output_directory={tmp_path}",
            "run_name=r"]
    _sigterm_at_call(monkeypatch, 6)  # step 6 is being dispatched: it is finished and saved
    code = cli.main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == preemption.EXIT_CODE == cli.EXIT_PREEMPTED == 143, err
    assert len(lines) == 1 and "Traceback" not in err, lines
    ckpt_dir = os.path.join(tmp_path, "r", "checkpoints")
    assert lines[0] == (f"dropless: preempted (SIGTERM) after step 6 of 8; saved checkpoint "
                        f"{os.path.join(ckpt_dir, '6')}; the same command resumes from step 6")
    assert ckpt_lib.complete_steps_in(ckpt_dir) == [4, 6]  # 6: forced, not due (period 4)
    ckpt_lib.verify_manifest(os.path.join(ckpt_dir, "6"))  # every file written, as recorded
    assert _steps(tmp_path / "r") == [1, 2, 3, 4, 5, 6]  # the saved step's row too
    assert signal.getsignal(signal.SIGTERM) is sentinel_handler

    monkeypatch.undo()
    assert cli.main(args) == 0
    out = "".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert f"resumingfrom{os.path.join(ckpt_dir, '6')}" in out and "8(2thisrun,resumedfrom6)" in out
    assert _steps(tmp_path / "r") == list(range(1, 9))
    assert signal.getsignal(signal.SIGTERM) is sentinel_handler  # after a run that ended normally


def test_sigterm_with_checkpointing_off_says_nothing_was_saved(capsys, tmp_path, monkeypatch):
    _sigterm_at_call(monkeypatch, 3)
    code = cli.main(["train", *SMALL, "steps=8", "enable_checkpointing=false",
                     f"base_output_directory={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 143 and "\n" not in err, err
    (name,) = os.listdir(tmp_path)
    for needle in ("preempted (SIGTERM) after step 3 of 8", "nothing saved (enable_checkpointing=false)",
                   f"the same command with run_name={name} starts again from the beginning"):
        assert needle in err, (needle, err)
    assert not os.path.exists(tmp_path / name / "checkpoints")
    assert _steps(tmp_path / name) == [1, 2, 3]


# --- the watch itself, without training ------------------------------------------------------


class _Exits:
    """Stands in for ``os._exit`` (called from the watcher thread): records the code."""

    def __init__(self):
        self.codes = []

    def __call__(self, code):
        self.codes.append(code)

    def wait(self, n: int = 1, timeout_s: float = 5.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while len(self.codes) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.codes


def _watch(exits, lines, start=0):
    def at_once_line(stopping_at):
        lines.append(stopping_at)
        return f"ended at once ({stopping_at})"

    return preemption.watch(start=start, at_once_line=at_once_line, say=lines.append, exit=exits)


def test_sigterm_before_the_first_step_ends_at_once(capsys, sentinel_handler):
    """During the compile the main thread is inside XLA and runs no Python handler: the
    watcher thread ends the process itself (here it only records the exit)."""
    exits, lines = _Exits(), []
    with _watch(exits, lines, start=3) as w:
        assert signal.getsignal(signal.SIGTERM) is not sentinel_handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits.wait() == [143]
    assert lines == [None]
    assert capsys.readouterr().err == "dropless: ended at once (None)\n"
    assert signal.getsignal(signal.SIGTERM) is sentinel_handler
    assert w.reached(4)  # had the process lived, the loop would stop


def test_first_sigterm_after_the_first_step_stops_the_loop_and_a_second_ends_at_once(
        capsys, sentinel_handler):
    exits, lines = _Exits(), []
    with _watch(exits, lines, start=3) as w:
        assert not w.reached(4)
        w.first_step_done()
        os.kill(os.getpid(), signal.SIGTERM)
        assert w.reached(5) and exits.wait(timeout_s=0.3) == []  # stop after step 5; no exit
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. while step 5 is being saved
        assert exits.wait() == [143]
    assert lines == [5]
    assert capsys.readouterr().err == "dropless: ended at once (5)\n"
    assert signal.getsignal(signal.SIGTERM) is sentinel_handler


def test_at_once_lines(tmp_path):
    """What the line says when the process ends at once: nothing to save while compiling;
    a save cut off by a second SIGTERM is named and the newest complete checkpoint given."""
    train = TrainConfig(run_name="r", steps=8)
    run_dir = str(tmp_path / "r")
    ckpt_dir = tmp_path / "r" / "checkpoints"
    for step in (4, 6):
        (ckpt_dir / str(step)).mkdir(parents=True)
    (ckpt_dir / "4" / ckpt_lib.MANIFEST).write_text("{}")  # 6: written, not sealed yet
    compiling = loop._preempted_at_once_message(train, run_dir, 2, None)
    assert compiling.startswith("preempted (SIGTERM) before step 3 finished (compiling); nothing to save;")
    cut = loop._preempted_at_once_message(train, run_dir, 2, 6)
    assert cut == (f"preempted by a second SIGTERM while saving step 6: that save was still in progress "
                   f"and is not used; checkpoint {ckpt_dir / '4'} is the newest; the same command "
                   "resumes from step 4")


def test_several_processes_ask_jax_at_every_step(monkeypatch, sentinel_handler):
    """With several processes JAX's preemption service decides (every process the same step).
    It is asked with the global step, as Orbax's saves ask it, first with the run's starting
    step (JAX's counter starts at 0); no Python handler replaces JAX's own SIGTERM handler."""
    asked = []

    def reached_preemption_sync_point(n):
        asked.append(n)
        return n == 12

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", reached_preemption_sync_point)
    with _watch(_Exits(), [], start=10) as w:
        assert signal.getsignal(signal.SIGTERM) is sentinel_handler
        assert [w.reached(step) for step in (11, 12)] == [False, True]
    assert asked == [10, 11, 12]  # 10: before the steps, also the check that the service is on


def test_several_processes_without_the_preemption_service_say_so(monkeypatch, sentinel_handler):
    def service_off(n):
        raise RuntimeError("Preemption sync manager has not been initialized.")

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", service_off)
    lines = []
    with _watch(_Exits(), lines) as w:
        assert w is None and signal.getsignal(signal.SIGTERM) is sentinel_handler
    assert len(lines) == 1 and "jax_enable_preemption_service is off" in lines[0], lines
