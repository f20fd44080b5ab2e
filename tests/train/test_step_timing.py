"""Step timing of the training loop against a simulated device with a virtual clock.

``FakeDevice`` runs steps one after another on one stream, each taking
``STEP_S`` of device time, and reproduces what the H200 logs showed:

* dispatch is asynchronous but blocks part-way into the step it dispatches
  (``sync_frac``; the step's ``lax.cond`` makes the host read a predicate), so
  a metrics fetch one step late returns long after that step finished, and
  the last step's row used to get only the step's tail (27 ms of 1255 ms);
* a checkpoint save holds the host for ``SAVE_S`` after the state is ready,
  and afterwards the background writer sometimes holds the host for
  ``STALL_S`` just as a metrics fetch returns (a late reading of the clock
  while the device runs on: the next row came out shorter than the step);
* the first dispatch compiles for ``COMPILE_S``.

The true per-step device time comes from the fake's own record of when each
step ran; every reported step time must be at least its window's mean device
time, and at most that plus the host time the fake injected into the run
(dispatches and stalls; never a save).
"""

import io
import types

import numpy as np
import pytest
from rich.console import Console

from dropless.train import checkpoint as ckpt_lib
from dropless.train import host_pool, loop
from dropless.train import metrics as metrics_lib

STEP_S = 1.0  # device time of every step
DISPATCH_S = 1e-3  # host time to enqueue a step
COMPILE_S = 50.0
SAVE_S = 40.0  # a save's hold on the host (waiting for the previous + copy to host)
STALL_S = 0.3  # the background writer holding the host during a fetch
TOKENS, TFLOPS, PEAK = 1000, 400.0, 1000.0


class _Out(dict):
    """A step's metrics as the fake device returns them: ready at ``done``."""

    done: float


class FakeDevice:
    """A virtual clock, one device stream, and the host's view of it."""

    def __init__(self, sync_frac: float):
        self.sync_frac = sync_frac
        self.now = 0.0  # host time
        self.free = 0.0  # when the device finishes what is queued
        self.ran = []  # (device start, device end) of each step, in order
        self.stall_fetches = set()  # indices of fetches that stall
        self.fetches = 0
        self.stalled_s = 0.0

    def clock(self) -> float:
        return self.now

    def step_fn(self, state, batch):
        if not self.ran:
            self.now += COMPILE_S
        self.now += DISPATCH_S
        start = max(self.now, self.free)
        self.free = start + STEP_S
        self.now = max(self.now, start + self.sync_frac * STEP_S)  # host reads the cond predicate
        self.ran.append((start, self.free))
        out = _Out(loss=1.0, lm_loss=1.0, aux_loss=0.0, mtp_loss=0.0, grad_norm=1.0,
                   learning_rate=1e-3, finite=True, applied=True, skipped_steps=0)
        out.done = self.free
        return state + 1, out

    def fetch(self, out: _Out) -> _Out:
        self.now = max(self.now, out.done)
        if self.fetches in self.stall_fetches:
            self.now += STALL_S
            self.stalled_s += STALL_S
        self.fetches += 1
        return out


class FakeCheckpointer:
    """``due``/``save``/``poll`` of ``checkpoint.Checkpointer``; a save holds the host
    (no device snapshot: Orbax's copy to host is the save's hold)."""

    device_snapshot = False

    def __init__(self, device: FakeDevice, period: int):
        self.device, self.period = device, period
        self.saved, self.last_timing = [], None

    def take_handoff_seconds(self):
        return None

    def due(self, step, *, force=False):
        return force or step % self.period == 0

    def save(self, step, state, *, force=False):
        if not self.due(step, force=force):
            return False
        dev = self.device
        dev.now = max(dev.now, dev.free) + SAVE_S  # the copy to host waits for the state
        self.saved.append(step)
        self.last_timing = ckpt_lib.SaveTiming(step, SAVE_S / 2, SAVE_S)
        # The writer thread then holds the host during the 2nd fetch after the save.
        dev.stall_fetches.add(dev.fetches + 1)
        return True

    def poll(self):
        pass


def _run(tmp_path, monkeypatch, *, steps, period, sync_frac, start=0):
    dev = FakeDevice(sync_frac)
    monkeypatch.setattr(loop, "_clock", dev.clock)
    monkeypatch.setattr(loop, "_fetch", dev.fetch)
    monkeypatch.setattr(loop, "_jit_step", lambda s: dev.step_fn)
    monkeypatch.setattr(loop, "_overflow_monitor", lambda s, console: None)
    feed = types.SimpleNamespace(local=lambda step: step, put=lambda x: x)
    s = types.SimpleNamespace(feed=feed, mesh=types.SimpleNamespace(size=1),
                              flops=types.SimpleNamespace(total=TFLOPS), peak=PEAK,
                              source=types.SimpleNamespace(entropy_floor=None))
    train = types.SimpleNamespace(steps=steps, checkpoint_warm_host_memory=False)
    ckpt = FakeCheckpointer(dev, period) if period else None
    writer = metrics_lib.MetricsWriter(str(tmp_path), enable_tensorboard=False, resume_step=start)
    console = Console(file=io.StringIO(), width=200)
    ran = loop._train_steps(s, train, start, start, ckpt, writer, console, TOKENS)
    writer.close()
    result = loop._result(s, str(tmp_path), writer, ran.rows, ran, None, 1, TOKENS, 0.0, None)
    return dev, ckpt, ran, result, console.file.getvalue()


def _check_rows(dev, ran, start):
    """Each timed row against the fake's record of the steps its window covers."""
    timed = [r for r in ran.rows if "step_time_s" in r]
    assert timed
    covered = []
    host_s = len(dev.ran) * DISPATCH_S + dev.stalled_s  # all host time injected outside saves
    for r in timed:
        n = r.get("step_time_steps", 1)
        steps = range(r["step"] - n + 1, r["step"] + 1)
        covered += steps
        device_s = [dev.ran[i - 1 - start][1] - dev.ran[i - 1 - start][0] for i in steps]
        assert r["step_time_s"] * n >= sum(device_s) - 1e-9, r  # never below the device time
        assert r["step_time_s"] * n <= sum(device_s) + host_s + 1e-9, r  # no save, no compile
        assert r["tflops_per_device"] == pytest.approx(TFLOPS / r["step_time_s"], rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(TOKENS / r["step_time_s"], rel=1e-12)
        assert r["mfu"] == pytest.approx(TFLOPS / r["step_time_s"] / PEAK, rel=1e-12)
    # Every step but the compiling first is in exactly one window.
    assert covered == list(range(start + 2, start + len(dev.ran) + 1))
    return timed


@pytest.mark.parametrize("sync_frac", [0.0, 0.5, 0.97])
def test_last_step_time_is_a_whole_step(tmp_path, monkeypatch, sync_frac):
    """No checkpoints: the last row reports the full step (the H200 showed 27 ms)."""
    dev, _, ran, result, text = _run(tmp_path, monkeypatch, steps=20, period=0, sync_frac=sync_frac)
    timed = _check_rows(dev, ran, 0)
    assert timed[-1]["step"] == 20
    assert timed[-1]["step_time_s"] == pytest.approx(STEP_S, abs=DISPATCH_S)
    assert result.step_time_s == pytest.approx(STEP_S, abs=DISPATCH_S)
    assert result.step_time_s >= STEP_S


@pytest.mark.parametrize("sync_frac", [0.0, 0.5, 0.97])
def test_steps_around_saves_exclude_the_save(tmp_path, monkeypatch, sync_frac):
    """Saves every 10 steps and a host stall after each: no row below the device time,
    none carrying the save, and the summary's median is the device step time (the
    stalls touch fewer than half the steps)."""
    dev, ckpt, ran, result, text = _run(tmp_path, monkeypatch, steps=43, period=10,
                                        sync_frac=sync_frac)
    assert ckpt.saved == [10, 20, 30, 40, 43] and dev.stalled_s == 4 * STALL_S
    timed = _check_rows(dev, ran, 0)
    rows = {r["step"]: r for r in ran.rows}
    for step in (11, 21, 31, 41):  # the save's blocking time is reported, not timed
        assert rows[step]["checkpoint_blocked_s"] == SAVE_S
    # The summary's median is the median over steps of what the rows say.
    per_step = [r["step_time_s"] for r in timed for _ in range(r["step_time_steps"])]
    assert result.step_time_s == float(np.median(per_step))
    assert STEP_S <= result.step_time_s <= STEP_S + DISPATCH_S
    assert result.checkpoint_blocked_s == 5 * SAVE_S


def test_first_step_is_compile_and_untimed(tmp_path, monkeypatch):
    """The first step of an invocation (here a resume from step 7) compiles: its row has
    no step time, says so, and the result's compile_s is compile plus that one step."""
    dev, _, ran, result, text = _run(tmp_path, monkeypatch, steps=19, period=0, sync_frac=0.5,
                                     start=7)
    first = ran.rows[0]
    assert first["step"] == 8 and "step_time_s" not in first
    assert first["compile_s"] == result.compile_s
    assert result.compile_s == pytest.approx(COMPILE_S + DISPATCH_S + STEP_S, rel=1e-12)
    _check_rows(dev, ran, 7)


class FakeWarmup:
    """A host memory warm-up still running at the first save: its ``wait`` holds the
    host ``WARM_WAIT_S`` once; it has ended by then and reports once."""

    WARM_WAIT_S = 7.0

    def __init__(self, device: FakeDevice):
        self.device, self.ended = device, False

    def wait(self):
        if self.ended:
            return 0.0
        self.device.now += self.WARM_WAIT_S
        self.ended = True
        return self.WARM_WAIT_S

    def report(self):
        if not self.ended or self.device is None:
            return None
        self.device = None
        return host_pool.WarmResult(12.5, 3 * ckpt_lib.GiB)


def test_a_save_that_waits_for_the_warmup_reports_it(tmp_path, monkeypatch):
    """The first save's wait for the warm-up is in its held time (the row after it,
    and the result's first-save figure), in no step time; the warm-up's line and
    figures come with the first row after it ended; later saves do not wait."""
    warmups = []

    def start(s, train, ckpt, console):
        warmups.append(FakeWarmup(ckpt.device))
        return warmups[-1]

    monkeypatch.setattr(loop, "_start_warmup", start)
    dev, ckpt, ran, result, text = _run(tmp_path, monkeypatch, steps=23, period=10, sync_frac=0.5)
    assert len(warmups) == 1 and ckpt.saved == [10, 20, 23]
    _check_rows(dev, ran, 0)
    rows = {r["step"]: r for r in ran.rows}
    wait = FakeWarmup.WARM_WAIT_S
    assert rows[11]["checkpoint_warm_wait_s"] == wait
    assert rows[11]["checkpoint_blocked_s"] == SAVE_S + wait
    assert rows[11]["checkpoint_warm_s"] == 12.5 and rows[11]["checkpoint_warm_gib"] == 3.0
    assert "checkpoint_warm_wait_s" not in rows[21] and rows[21]["checkpoint_blocked_s"] == SAVE_S
    assert [r["step"] for r in ran.rows if "checkpoint_warm_s" in r] == [11]
    assert result.checkpoint_first_blocked_s == SAVE_S + wait
    assert result.checkpoint_blocked_s == 3 * SAVE_S + wait
    assert text.count("pinned host memory warmed in 12.5 s (3.00 GiB)") == 1


def test_printed_lines_say_what_they_average(tmp_path, monkeypatch):
    """Every printed line with a time names the steps it is the mean of."""
    dev, _, ran, result, text = _run(tmp_path, monkeypatch, steps=40, period=0, sync_frac=0.5)
    lines = [x for x in text.splitlines() if "ms/step" in x]
    assert lines and all("mean of steps" in x for x in lines), text
    assert "step     40" in text and "mean of steps 37-40" in text


def test_median_counts_each_step_once():
    """The summary median over steps, each step at its window's mean: one slow window of
    one step does not weigh as much as a window of nine."""
    assert metrics_lib.median_step_time([(1.0, 9), (5.0, 1)]) == 1.0
    assert metrics_lib.median_step_time([(1.0, 1), (5.0, 1), (3.0, 2)]) == 3.0
    assert metrics_lib.median_step_time([]) is None
    assert metrics_lib.median_step_time([(2.0, 3)]) == float(np.median([2.0] * 3))
