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
import re
import types

import numpy as np
import pytest
from rich.console import Console

from dropless.perf import clocks as clocks_lib
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
        if self.sync_frac is not None:  # None: dispatch never waits for the device
            self.now = max(self.now, start + self.sync_frac * STEP_S)  # host reads the cond predicate
        self.ran.append((start, self.free))
        out = _Out(loss=1.0, lm_loss=1.0, aux_loss=0.0, mtp_loss=0.0, grad_norm=1.0,
                   learning_rate=1e-3, finite=True, applied=True, skipped_steps=0)
        out.done = self.free
        return state + 1, out

    def ready(self, out: _Out) -> bool:
        return out.done <= self.now

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


def _run(tmp_path, monkeypatch, *, steps, period, sync_frac, start=0, put_hook=None):
    dev = FakeDevice(sync_frac)
    monkeypatch.setattr(loop, "_clock", dev.clock)
    monkeypatch.setattr(loop, "_fetch", dev.fetch)
    monkeypatch.setattr(loop, "_ready", dev.ready)
    monkeypatch.setattr(loop, "_jit_step", lambda s: dev.step_fn)
    monkeypatch.setattr(loop, "_overflow_monitor", lambda s, console: None)
    feed = types.SimpleNamespace(local=lambda step: step,
                                 put=lambda x: (put_hook and put_hook(), x)[1])
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
        # No save, no compile; a wait for the warm-up where the quiet steps end is in its window.
        assert r["step_time_s"] * n <= sum(device_s) + host_s + r.get("checkpoint_warm_held_s", 0) + 1e-9, r
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
    """The pinned host memory warm-up on the fake's clock: it runs ``warm_s`` from
    ``start``, and while it runs a batch put or metrics fetch by the loop is a
    ``violation`` (on the H200 each such copy waits for the pinning:
    ``ckpt_transfer-20261202-164033``). ``estimate_s`` is what the loop plans with."""

    nbytes = 3 * ckpt_lib.GiB

    def __init__(self, device: FakeDevice, warm_s: float, estimate_s: float):
        self.device, self.warm_s, self._estimate_s = device, warm_s, estimate_s
        self.t0, self.reported, self.violations = None, False, 0

    @property
    def started(self):
        return self.t0 is not None

    def start(self):
        self.t0 = self.device.now

    def estimate_s(self):
        return self._estimate_s

    def running(self):
        return self.started and self.device.now < self.t0 + self.warm_s

    def check(self):
        self.violations += self.running()

    def wait(self):
        if not self.running():
            return 0.0
        held = self.t0 + self.warm_s - self.device.now
        self.device.now = self.t0 + self.warm_s
        return held

    def report(self):
        if self.reported or not self.started or self.running():
            return None
        self.reported = True
        return host_pool.WarmResult(self.warm_s, self.nbytes)


def _run_warm(tmp_path, monkeypatch, *, steps, period, sync_frac, warm_s, estimate_s):
    warmups = []

    def plan(s, train, ckpt, console):
        warmups.append(FakeWarmup(ckpt.device, warm_s, estimate_s))
        return warmups[-1]

    monkeypatch.setattr(loop, "_plan_warmup", plan)
    fetch = FakeDevice.fetch
    monkeypatch.setattr(FakeDevice, "fetch", lambda self, out: (warmups[0].check(), fetch(self, out))[1])
    out = _run(tmp_path, monkeypatch, steps=steps, period=period, sync_frac=sync_frac,
               put_hook=lambda: warmups[0].check())
    assert len(warmups) == 1
    return (*out, warmups[0])


def _quiet_span(text):
    """The quiet steps the loop announced (first, last)."""
    m = re.search(r"pinning 3.00 GiB of host memory for the first save \(about \d+ s\); "
                  r"steps (\d+)-(\d+) run from batches put on the device beforehand \(in 0.0 s\)", text)
    assert m, text
    return int(m[1]), int(m[2])


@pytest.mark.parametrize("sync_frac", [0.0, 0.5, 0.97])
def test_the_warmup_runs_beside_quiet_steps(tmp_path, monkeypatch, sync_frac):
    """After the first timed window the loop stages 1.5x the warm-up's estimated span
    of batches and runs those steps with no put and no fetch while it pins; the device
    never waits for the host meanwhile; every row comes, in order, with honest step
    times; the first save holds only its own time."""
    dev, ckpt, ran, result, text, warm = _run_warm(tmp_path, monkeypatch, steps=60, period=50,
                                                   sync_frac=sync_frac, warm_s=12.0, estimate_s=12.0)
    assert warm.violations == 0
    first, last = _quiet_span(text)
    assert first == 7 and last == first + 18 - 1  # the first window ends at the first printed step, 6
    assert [r["step"] for r in ran.rows] == list(range(1, 61))
    _check_rows(dev, ran, 0)
    gaps = [dev.ran[i][0] - dev.ran[i - 1][1] for i in range(first - 1, last)]
    assert max(gaps) <= DISPATCH_S + 1e-9  # the device ran the quiet steps back to back
    rows = {r["step"]: r for r in ran.rows}
    assert ckpt.saved == [50, 60] and rows[51]["checkpoint_blocked_s"] == SAVE_S
    assert result.checkpoint_first_blocked_s == SAVE_S
    assert text.count("pinned host memory warmed in 12.0 s (3.00 GiB)") == 1
    # The fake's dispatch waits for the step to start (at least), so the host keeps pace
    # with the device and the warm-up ends before the staged batches do: no wait.
    assert not any("checkpoint_warm_held_s" in r for r in ran.rows)
    assert [r["step"] for r in ran.rows if "checkpoint_warm_s" in r] == [first]  # the first held-back row
    # The quiet steps end with the step in which the 12 s warm-up ended, as one window.
    quiet_window = [r for r in ran.rows if "step_time_s" in r and r["step"] - r["step_time_steps"] + 1 == first]
    assert len(quiet_window) == 1 and 12 <= quiet_window[0]["step_time_steps"] <= 13 < last - first + 1


def test_a_warmup_longer_than_its_batches_is_waited_for_and_reported(tmp_path, monkeypatch):
    """Planned from an estimate a third of the truth, the staged batches run out first:
    the loop waits for the warm-up (no transfer before it ends) and puts the wait on
    that step's row; the device ran dry during it, so a line says so, and the
    window's step time includes it."""
    dev, ckpt, ran, result, text, warm = _run_warm(tmp_path, monkeypatch, steps=60, period=50,
                                                   sync_frac=0.5, warm_s=12.0, estimate_s=4.0)
    assert warm.violations == 0
    first, last = _quiet_span(text)
    assert last - first + 1 == 6
    held = [r for r in ran.rows if "checkpoint_warm_held_s" in r]
    assert [r["step"] for r in held] == [last]
    # The host is half-way into the 6th quiet step (sync_frac) when it finds no batch left;
    # of the dispatches only the first adds host time (the others wait for the device).
    assert held[0]["checkpoint_warm_held_s"] == pytest.approx(12.0 - 5.5 * STEP_S - DISPATCH_S)
    assert (f"warm-up outlasted the quiet steps: the device may have idled up to "
            f"{held[0]['checkpoint_warm_held_s']:.1f} s after step {last}") in text
    assert [r["step"] for r in ran.rows] == list(range(1, 61))
    window = held[0]["step_time_s"] * held[0]["step_time_steps"]
    assert window == pytest.approx(12.0)  # from the warm-up's start to its end: the steps ran inside


def test_a_host_ahead_of_the_device_waits_without_loss(tmp_path, monkeypatch):
    """Where dispatch never waits (the host queues all 18 quiet steps at once), the host
    waits out the warm-up while the device works through them: the wait is on the row,
    no idle line is printed, and the window's step time is the device's."""
    dev, ckpt, ran, result, text, warm = _run_warm(tmp_path, monkeypatch, steps=60, period=50,
                                                   sync_frac=None, warm_s=12.0, estimate_s=12.0)
    assert warm.violations == 0
    first, last = _quiet_span(text)
    held = [r for r in ran.rows if "checkpoint_warm_held_s" in r]
    assert [r["step"] for r in held] == [last] and held[0]["checkpoint_warm_held_s"] > 11.9
    assert "may have idled" not in text
    assert held[0]["step_time_s"] == pytest.approx(STEP_S, abs=DISPATCH_S)
    _check_rows(dev, ran, 0)


def test_a_save_inside_the_quiet_steps_ends_them(tmp_path, monkeypatch):
    """A save due before the warm-up ends: the loop waits for it (reported), writes the
    held-back rows, then the save's row, then saves with its own hold only."""
    dev, ckpt, ran, result, text, warm = _run_warm(tmp_path, monkeypatch, steps=30, period=10,
                                                   sync_frac=0.5, warm_s=12.0, estimate_s=12.0)
    assert warm.violations == 0
    assert [r["step"] for r in ran.rows] == list(range(1, 31))
    first, last = _quiet_span(text)
    rows = {r["step"]: r for r in ran.rows}
    assert first == 4 and rows[10]["checkpoint_warm_held_s"] > 0  # the window ended at step 3
    assert ckpt.saved == [10, 20, 30] and rows[11]["checkpoint_blocked_s"] == SAVE_S
    _check_rows(dev, ran, 0)


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


def test_timed_rows_carry_the_windows_gpu_clock_and_power(tmp_path, monkeypatch, fake_nvml):
    """On a GPU each timed row has its window's median SM clock and power (NVML, read by
    ``perf.clocks`` in the background); the compiling first row has none, and each
    window summarises only its own samples, so the clock the rows report keeps falling."""
    reader = fake_nvml(sm_mhz=1980.0, step=-10.0, power_w=690.0)  # 10 MHz lower each reading
    monkeypatch.setattr(loop, "_clock_sampler", lambda: clocks_lib.ClockSampler(
        interval_s=3600.0, open_reader=lambda index: reader))  # entry and exit samples only
    dev, _, ran, result, text = _run(tmp_path, monkeypatch, steps=25, period=0, sync_frac=0.5)
    timed = _check_rows(dev, ran, 0)
    assert "gpu_sm_mhz" not in ran.rows[0] and "compile_s" in ran.rows[0]
    mhz = [r["gpu_sm_mhz"] for r in timed]
    assert all(r["gpu_power_w"] == 690.0 for r in timed)
    # Two readings per window (its start and its end), 10 MHz apart: the median lies between.
    assert mhz == sorted(mhz, reverse=True) and len(set(mhz)) == len(mhz)
    assert mhz[0] == 1980.0 - 15.0
    assert all(r.get("gpu_sm_mhz") is None for r in ran.rows if "step_time_s" not in r)
    assert "MHz, 690 W" in metrics_lib.format_row(timed[-1])


def test_without_nvml_the_run_says_once_that_rows_have_no_gpu_clocks(tmp_path, monkeypatch):
    """A GPU where NVML cannot be read (no pynvml): one line says why, the rows go on."""
    def no_nvml(index):
        raise clocks_lib.ClocksUnavailable("pynvml not importable")

    monkeypatch.setattr(loop, "_clock_sampler",
                        lambda: clocks_lib.ClockSampler(open_reader=no_nvml))
    dev, _, ran, _, text = _run(tmp_path, monkeypatch, steps=12, period=0, sync_frac=0.5)
    _check_rows(dev, ran, 0)
    assert text.count("no GPU clock or power in the rows (pynvml not importable)") == 1
    assert not any("gpu_sm_mhz" in r for r in ran.rows)


def test_rows_off_a_gpu_have_no_gpu_fields(tmp_path, monkeypatch):
    """The tests' CPU device: ``_clock_sampler`` gives none, and rows have no GPU fields."""
    assert loop._clock_sampler() is None
    _, _, ran, _, _ = _run(tmp_path, monkeypatch, steps=12, period=0, sync_frac=0.5)
    assert not any("gpu_sm_mhz" in r or "gpu_power_w" in r for r in ran.rows)
