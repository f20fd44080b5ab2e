"""Per-step metrics: derived numbers, ``metrics.jsonl``, TensorBoard, the console.

Legend: L MoE layers, E routed experts.

Each step's device metrics (from ``train.step``) become one flat row with
MoE load figures (min/max tokens per expert, coefficient of variation of the
load across experts averaged over layers, dropped tokens). The row that ends
a timing window (``StepWindows``) also has the throughput figures: the mean
step time over the window's ``step_time_steps`` steps, tokens/s, TFLOP/s per
device from the analytic count, MFU when the device's peak is known, and on a
GPU the window's median SM clock and power draw (``gpu_sm_mhz``, ``gpu_power_w``:
a sustained step runs at the board's power limit, below the rated clock). The
first step of an invocation compiles: its row has ``compile_s`` (compile plus
that step) and no step time. Rows go to

* ``<run_dir>/metrics.jsonl``: one JSON object per step, keys as in ``Row``;
* TensorBoard (``<run_dir>/tensorboard``) under MaxText's tag names;
* a rich progress bar (loss, TFLOP/s/device, ETA) and, every tenth of the
  run, a plain log line, so non-interactive logs show progress too.
"""

import json
import math
import os
import time
import uuid

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# Our row key -> MaxText's TensorBoard tag.
TENSORBOARD_TAGS = {
    "loss": "learning/loss",
    "lm_loss": "learning/lm_loss",
    "aux_loss": "learning/moe_lb_loss",
    "mtp_loss": "learning/mtp_loss",
    "grad_norm": "learning/raw_grad_norm",
    "learning_rate": "learning/current_learning_rate",
    "step_time_s": "perf/step_time_seconds",
    "tflops_per_device": "perf/per_device_tflops_per_sec",
    "tokens_per_s_per_device": "perf/per_device_tokens_per_sec",
    "mfu": "perf/mfu",
    "gpu_sm_mhz": "perf/gpu_sm_clock_mhz",
    "gpu_power_w": "perf/gpu_power_watts",
    "moe_tokens_min": "moe/tokens_per_expert_min",
    "moe_tokens_max": "moe/tokens_per_expert_max",
    "moe_load_cv": "moe/load_cv",
    "dropped_tokens": "moe/dropped_tokens",
    "overflow_tokens": "moe/ep_overflow_tokens",
    "buffer_factor_needed": "moe/ep_buffer_factor_needed",
    "ep_rows_sent": "moe/ep_rows_sent",
    "ep_rows_saved": "moe/ep_rows_saved",
    "ep_extra_rounds": "moe/ep_extra_rounds",
    "skipped_steps": "learning/skipped_steps",
    "checkpoint_wait_s": "checkpoint/wait_for_previous_save_seconds",
    "checkpoint_blocked_s": "checkpoint/blocked_seconds",
    "checkpoint_warm_held_s": "checkpoint/wait_for_host_memory_warmup_seconds",
    "checkpoint_warm_s": "checkpoint/host_memory_warmup_seconds",
}


def moe_load_stats(tokens_per_expert_LE: np.ndarray) -> dict:
    """min/max tokens per expert over all layers, and the mean over layers of the load CV."""
    load = np.asarray(tokens_per_expert_LE, np.float64)
    mean_L = load.mean(axis=-1)
    cv_L = load.std(axis=-1) / np.maximum(mean_L, 1e-9)
    return {
        "moe_tokens_min": int(load.min()),
        "moe_tokens_max": int(load.max()),
        "moe_load_cv": float(cv_L.mean()),
    }


def final_lm_loss(rows: list[dict]) -> float | None:
    """Mean ``lm_loss`` over the last tenth of ``rows`` (at least the last row); None if empty.

    The run summary's "final LM loss (mean of last 10%)", the figure to compare
    with the data's entropy floor: averaging smooths the step-to-step noise.
    """
    tail = rows[-max(1, len(rows) // 10):]
    return float(np.mean([r["lm_loss"] for r in tail])) if tail else None


def make_row(step: int, raw: dict, *, step_time: float | None, tokens_per_step: int,
             num_devices: int, tflops_per_step: float, peak_tflops: float | None,
             timed_steps: int = 1) -> dict:
    """One metrics row (plain Python numbers) for the step that just finished.

    Args:
      step: 1-based number of steps done after this one.
      raw: the train step's metrics, fetched to host.
      step_time: mean seconds per step over the ``timed_steps`` steps ending
        with this one (``StepWindows``), or None: no timing on this row.
      tokens_per_step: global tokens per optimizer step.
      tflops_per_step: analytic TFLOPs per device per step (``flops.TrainingFlops.total``).
      peak_tflops: the device's dense peak, or None (no MFU).
      timed_steps: how many steps ``step_time`` is the mean of (``step_time_steps``).
    """
    row = {"step": step}
    for key in ("loss", "lm_loss", "aux_loss", "mtp_loss", "grad_norm", "learning_rate"):
        row[key] = float(raw[key])
    row["finite"] = bool(raw["finite"])
    row["applied"] = bool(raw["applied"])
    row["skipped_steps"] = int(raw["skipped_steps"])
    if "tokens_per_expert" in raw:
        row.update(moe_load_stats(raw["tokens_per_expert"]))
        for key in ("dropped_tokens", "ep_rows_sent", "ep_rows_saved", "ep_extra_rounds"):
            row[key] = int(raw[key])
        row["overflow_tokens"] = int(np.sum(raw["overflow_tokens"]))  # per layer on device
        row["buffer_factor_needed"] = float(np.max(raw["buffer_factor_needed"]))
    if step_time is not None:
        if not step_time > 0:
            raise ValueError(f"step_time={step_time} s must be > 0")
        row["step_time_s"] = step_time
        row["step_time_steps"] = timed_steps
        row["tokens_per_s"] = tokens_per_step / step_time
        row["tokens_per_s_per_device"] = tokens_per_step / step_time / num_devices
        row["tflops_per_device"] = tflops_per_step / step_time
        if peak_tflops:
            row["mfu"] = row["tflops_per_device"] / peak_tflops
    return row


class StepWindows:
    """Step times as means over windows of consecutive steps, each between two
    moments at which none of the loop's work is left on the device.

    JAX dispatch is asynchronous and may also block part-way into the step it
    dispatches (a ``lax.cond`` in the step, such as expert parallelism's extra
    rounds, makes the host read its predicate on GPU), so the moment the host sees a step's metrics says little about
    when the device finished that step: a window's clock readings must be
    where nothing of ours is queued. ``open()`` before the window's first step
    is dispatched, with nothing of ours queued; ``close(n)`` right after the
    host has waited for the outputs of its last (n-th) step. The n steps ran
    one after another between the two readings, so the mean is never below
    their mean device time; it includes host time spent inside the window
    (dispatch, data, writing rows) that kept the device idle, and nothing done
    between windows (compiling, checkpoint saves).
    """

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._t0: float | None = None
        self.windows: list[tuple[float, int]] = []  # (mean seconds per step, steps)

    def open(self) -> None:
        self._t0 = self._clock()

    def close(self, steps: int) -> float:
        """The window's mean seconds per step; records it and ends the window."""
        if self._t0 is None:
            raise RuntimeError("StepWindows.close without open")
        if steps < 1:
            raise ValueError(f"a window of {steps} steps")
        mean = (self._clock() - self._t0) / steps
        self._t0 = None
        self.windows.append((mean, steps))
        return mean


def median_step_time(windows: list[tuple[float, int]]) -> float | None:
    """Median over steps of ``(mean, steps)`` windows, each step at its window's mean; None if empty."""
    if not windows:
        return None
    means, counts = zip(*windows)
    return float(np.median(np.repeat(np.asarray(means, np.float64), counts)))


def truncate_jsonl(path: str, last_step: int) -> None:
    """Keep rows with ``step <= last_step`` (a resumed run rewrites what follows).

    Unparsable lines (a row cut by a kill) are dropped too.
    """
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= last_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    """All rows of a metrics.jsonl (empty if absent)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` and TensorBoard under ``run_dir``.

    On creation, rows after ``resume_step`` (from a run killed after its last
    checkpoint) are dropped: the resumed run writes them again. TensorBoard's
    events of those steps stay in the old event file, so the new file starts
    with a purge marker (``purge_step``): TensorBoard then discards every
    earlier event at or after ``resume_step + 1`` and shows each step once.
    """

    def __init__(self, run_dir: str, *, enable_tensorboard: bool, resume_step: int,
                 log_period: int = 1, enabled: bool = True):
        os.makedirs(run_dir, exist_ok=True)
        self._log_period = max(1, log_period)
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        self._jsonl = self._tb = None
        if not enabled:  # processes other than 0 of a multi-process run
            return
        truncate_jsonl(self.jsonl_path, resume_step)
        self._jsonl = open(self.jsonl_path, "a")
        if enable_tensorboard:
            from tensorboardX import SummaryWriter

            # tensorboardX names the file by the second and host and opens it "wb": a
            # restart within the same second would erase the previous file without
            # a suffix of its own.
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step > 0 else None,
                                     filename_suffix=f".{uuid.uuid4().hex[:8]}")

    def write(self, row: dict) -> None:
        """Record one row; files are flushed every ``log_period`` steps (MaxText's meaning)."""
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, tag in TENSORBOARD_TAGS.items():
                value = row.get(key)
                if value is not None and math.isfinite(value):
                    self._tb.add_scalar(tag, value, row["step"])
        if row["step"] % self._log_period == 0:
            self._jsonl.flush()
            if self._tb is not None:
                self._tb.flush()

    def write_text(self, tag: str, text: str) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, text)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class ProgressDisplay:
    """A rich progress bar with live loss and TFLOP/s, plus periodic log lines."""

    def __init__(self, console: Console, total_steps: int, start_step: int):
        self.console = console
        self.total = total_steps
        self.every = max(1, total_steps // 10)  # steps between printed lines
        self._progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tflops]} TFLOP/s/dev"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=not console.is_terminal,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=start_step, loss="-", tflops="-"
        )

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc):
        self._progress.stop()

    def update(self, row: dict) -> None:
        tflops = row.get("tflops_per_device")  # on the rows that end a timing window
        fields = {"tflops": f"{tflops:.3g}"} if tflops else {}
        self._progress.update(self._task, completed=row["step"], loss=f"{row['loss']:.4f}", **fields)
        if self.prints(row["step"]) or not row["applied"] or "compile_s" in row:
            self._progress.console.print(format_row(row))

    def prints(self, step: int) -> bool:
        """Whether ``step``'s row is printed as a log line (every tenth of the run, the last)."""
        return step % self.every == 0 or step == self.total


def format_row(row: dict) -> str:
    """One human log line for a row."""
    parts = [f"step {row['step']:>6}", f"loss {row['loss']:.4f}", f"lm {row['lm_loss']:.4f}",
             f"gnorm {row['grad_norm']:.3g}", f"lr {row['learning_rate']:.3g}"]
    if "step_time_s" in row:
        n = row.get("step_time_steps", 1)
        span = f"step {row['step']}" if n == 1 else f"mean of steps {row['step'] - n + 1}-{row['step']}"
        parts += [f"{row['step_time_s'] * 1e3:.0f} ms/step", f"{row['tokens_per_s']:.4g} tok/s",
                  f"{row['tflops_per_device']:.3g} TFLOP/s/dev ({span})"]
        if "gpu_sm_mhz" in row:  # the training loop's NVML sampling of the window (GPU runs)
            power = f", {row['gpu_power_w']:.0f} W" if "gpu_power_w" in row else ""
            parts.append(f"GPU {row['gpu_sm_mhz']:.0f} MHz{power}")
    if "compile_s" in row:
        parts.append(f"compile + first step {row['compile_s']:.1f} s (untimed)")
    if "moe_load_cv" in row:
        parts.append(f"load cv {row['moe_load_cv']:.2f}")
    if not row["finite"]:
        parts.append("[red]NON-FINITE: step skipped[/red]")
    elif not row["applied"]:
        parts.append(f"[red]EP BUFFER OVERFLOW ({row.get('overflow_tokens')} rows): step skipped[/red]")
    return "  ".join(parts)


def summary_table(result_fields: dict, title: str = "dropless training summary") -> Table:
    """A two-column rich table of the final results."""
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for key, value in result_fields.items():
        if value is None:
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    return table
