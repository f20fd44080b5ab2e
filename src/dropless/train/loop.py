"""The training loop: ``run_training(model, train, mesh) -> TrainResult``.

What one call does, in order:

1. builds the mesh, the data source (printing its entropy floor when known),
   the optimizer and the abstract train state;
2. resumes from ``<base_output_directory>/<run_name>/checkpoints``' latest
   complete checkpoint if there is one, else loads ``load_parameters_path`` or
   ``hf_model_path`` (a Hugging Face directory) if set, else initialises from
   ``seed``;
3. runs the jitted step until ``steps``, with the next batch prepared on a
   host thread and each step's metrics read one step late (so the host never
   waits for the device it just fed) except where a timing window ends (at
   most every ``TIMING_WINDOW_STEPS`` steps, and at each printed step, save
   and the last step): there it waits for the step before dispatching the
   next, and the row carries the window's mean step time (``metrics.StepWindows``: never below the device
   time; compilation and saves are in no window); saves every ``checkpoint_period`` steps
   and at the end (a save's own metrics row is written first, so a run killed
   after it resumes with no gap in ``metrics.jsonl``); before the first step it
   checks that the checkpoint disk has room (``checkpoint.plan_disk``: one save
   or exit, all of them or a warning), and a save that fails ends the run with
   ``CheckpointSaveError``; a SIGTERM during the steps (``preemption``) saves
   the step in progress, waits for that save and ends with ``TrainingPreempted``;
4. prints a summary table and writes ``metrics.jsonl``, TensorBoard events and
   ``summary.png`` into the run directory.

A run without ``run_name`` gets a fresh timestamped one, so it never resumes
by accident; give ``run_name`` to make a run resumable. The run directory's
``config.json`` is written once; a resume with another config is refused
unless ``allow_config_change_on_resume`` (``train.run_dir``). Each save's
time holding the loop is reported on the next metrics row
(``checkpoint_wait_s``, ``checkpoint_blocked_s``), is in no step time, and is
summed in the summary. With ``checkpoint_warm_host_memory`` the pinned host
memory the first save needs is allocated in a background thread (``host_pool``)
during "quiet steps": after the first timed window the loop puts the next
steps' batches on the device (``_quiet_steps``: enough for 1.5 times the
warm-up's estimated span), starts the warm-up, and runs those steps without a
transfer between host and device (each would wait for the pinning: on the
H200 a loop that fetched a scalar per iteration ran 58x slower beside it, one
that moved nothing kept its speed). Their rows are written when it ends,
together; its line and ``checkpoint_warm_s`` come with them. A save, the last
step, a stop, or the staged batches running out end the quiet steps early:
the loop then waits for the warm-up and reports the wait as
``checkpoint_warm_held_s`` on that step's row, whose window's step time
includes whatever the device lost in it (the device runs the steps queued
meanwhile; a line says when they ran out before the wait ended). With
``checkpoint_device_snapshot`` a save copies the state on the device and Orbax
saves the copy from a background thread (``checkpoint``): its hold is the copy
and the handoff, and the seconds Orbax's save of the copy took beside the steps
come as ``checkpoint_background_s`` with the next row after it ended; before
the first step the step is compiled and the run refused if a second copy of
the state would not fit beside it (``_check_snapshot_room``).

Each process makes only the batch rows its devices hold (``BatchFeed``): the
data source generates or reads just those sequences, and
``jax.make_array_from_process_local_data`` assembles the global batch. The
rows are those of the single-process batch, so results do not depend on the
number of processes.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import math
import os
import time
import types
from typing import Iterator, NamedTuple

import jax
import numpy as np
from rich.console import Console

from dropless.config.loader import ConfigError
from dropless.config.sections import MeshConfig, ModelConfig, TrainConfig
from dropless.nn import moe as moe_lib
from dropless.nn.model import bf16_dense_matmuls_line, moe_layer_names
from dropless.parallel import ep as ep_lib
from dropless.parallel import mesh as mesh_lib
from dropless.parallel import overflow as overflow_lib
from dropless.perf import clocks as clocks_lib
from dropless.perf import memory as memory_lib
from dropless.train import checkpoint as ckpt_lib
from dropless.train import data as data_lib
from dropless.train import flops as flops_lib
from dropless.train import host_pool
from dropless.train import metrics as metrics_lib
from dropless.train import optimizer as opt_lib
from dropless.train import plots
from dropless.train import preemption
from dropless.train import remat as remat_lib
from dropless.train import run_dir as run_dir_lib
from dropless.train import step as step_lib
from dropless.train import user_errors


@dataclasses.dataclass
class TrainResult:
    """What a training run reports back (also printed as the summary table).

    ``final_loss`` is the last step's total loss; ``final_lm_loss_avg`` the mean
    LM loss over the last tenth of the steps (what to compare with
    ``entropy_floor``). Throughput figures are medians over this invocation's
    steps after the first (which compiles: ``compile_s`` is compile plus that
    step), each step counted at its timing window's mean
    (``metrics.StepWindows``); None if fewer than two steps ran.
    ``checkpoint_blocked_s`` is the time saves held the loop (waiting for the
    previous save plus the handoff to the background writer), summed over
    this invocation's ``checkpoint_saves``; ``checkpoint_first_blocked_s`` that of
    the first of them (the one that grows the pinned host memory pool).
    """

    ok: bool
    run_dir: str
    steps_run: int
    final_step: int
    resumed_from: int | None
    initial_loss: float | None
    final_loss: float | None
    final_lm_loss_avg: float | None
    entropy_floor: float | None
    skipped_steps: int
    num_params: int
    step_time_s: float | None
    tokens_per_s: float | None
    tflops_per_device: float | None
    mfu: float | None
    compile_s: float | None
    wall_s: float
    metrics_path: str
    plot_path: str | None
    checkpoint_saves: int = 0
    checkpoint_blocked_s: float = 0.0
    checkpoint_first_blocked_s: float | None = None
    record_path: str | None = None


class BatchFeed:
    """This process's rows of each step's batch, assembled into global arrays.

    The batch [A, B, S] is split over its B axis by ``mesh``'s batch axes and
    replicated over A; this process's devices hold sequences ``seqs`` of every
    microbatch, and only those are made. ``local(step)`` is the host part (run
    it on a data thread), ``put(local)`` makes the global ``jax.Array``s.
    """

    def __init__(self, source, mesh):
        self.source = source
        self.sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
        self.shape = (source.accum, source.batch, source.seq)
        self.seqs = mesh_lib.held_indices(self.sharding, self.shape, axis=1)

    def local(self, step: int) -> data_lib.Batch:
        """NumPy Batch [A, len(seqs), S]: this process's sequences of step ``step``."""
        return self.source.batch_at(step, self.seqs)

    def put(self, local: data_lib.Batch) -> data_lib.Batch:
        """Global Batch [A, B, S] of ``jax.Array``s sharded as ``sharding``."""
        return jax.make_array_from_process_local_data(self.sharding, local, self.shape)

    def __call__(self, step: int) -> data_lib.Batch:
        return self.put(self.local(step))


@dataclasses.dataclass
class _Setup:
    model: ModelConfig
    mesh_cfg: MeshConfig
    mesh: object
    source: object
    tx: object
    schedule: object
    graphdef: object
    init: object
    abstract: dict
    shardings: dict
    feed: BatchFeed
    global_batch: int
    flops: flops_lib.TrainingFlops
    peak: float | None


def _global_batch(train: TrainConfig, mesh) -> int:
    """Sequences per microbatch across all devices (``data.global_batch_size``).

    Raises:
      ValueError: a batch that is not a whole number, or does not split over the batch axes.
    """
    return data_lib.global_batch_size(train.per_device_batch_size, mesh.size,
                                      mesh_lib.batch_shards(mesh),
                                      f"mesh's batch ({' x '.join(mesh_lib.BATCH_AXES)})")


def _setup(model: ModelConfig, train: TrainConfig, mesh_cfg: MeshConfig) -> _Setup:
    if train.steps < 1:
        raise ValueError(f"steps={train.steps} must be >= 1")
    if train.gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={train.gradient_accumulation_steps} must be >= 1")
    if train.hf_model_path:  # a broken directory fails before anything compiles
        from dropless.hf.load import check

        check(train.hf_model_path, model)
    mesh = mesh_lib.make_mesh(mesh_cfg)
    global_batch = _global_batch(train, mesh)
    with user_errors.data_errors():
        source = data_lib.make_source(
            train.data, model.vocab_size, batch=global_batch, seq=train.max_target_length,
            accum=train.gradient_accumulation_steps,
        )
    tx = opt_lib.make_optimizer(train.optimizer, train.steps)
    schedule = opt_lib.learning_rate_schedule(train.optimizer, train.steps)
    # Always through parallel.ep: with an expert axis of 1 each device routes its own
    # tokens (shard_map; one device compiles to the plain block), where plain jit would
    # sort the global batch across devices (8 CPU devices, fsdp=8: 5x slower steps).
    ep = ep_lib.from_config(mesh, mesh_cfg)
    graphdef, init = step_lib.init_state_fn(model, tx, train.seed, remat_lib.layer_remat(model), ep)
    abstract = jax.eval_shape(init)
    device = jax.devices()[0]
    return _Setup(
        model=model, mesh_cfg=mesh_cfg, mesh=mesh, source=source, tx=tx, schedule=schedule,
        graphdef=graphdef, init=init, abstract=abstract, shardings=mesh_lib.param_shardings(mesh, abstract),
        feed=BatchFeed(source, mesh), global_batch=global_batch,
        flops=flops_lib.training_tflops_per_device(
            model, global_batch / mesh.size, train.max_target_length, train.gradient_accumulation_steps
        ),
        peak=None if device.platform == "cpu"
        else flops_lib.peak_tflops(device.device_kind, flops_lib.precision_of(model)),
    )


def _initial_state(s: _Setup, train: TrainConfig, ckpt, console):
    """(state, resumed_from_step or None)."""
    if ckpt is not None:
        latest, removed = ckpt.prepare_resume()
        if removed:
            console.print(f"[yellow]removed incomplete checkpoint(s) at step {removed}; "
                          "those steps are run and saved again[/yellow]")
        _check_disk(ckpt, train, latest or 0, console)
        if latest is not None:
            console.print(f"resuming from {ckpt.step_dir(latest)}")
            return ckpt.restore(latest, s.abstract, s.shardings), latest
    state = _start_state(s, train)
    if train.load_parameters_path or train.hf_model_path:
        console.print(f"loaded parameters from {train.load_parameters_path or train.hf_model_path}")
    return state, None


def _check_disk(ckpt, train: TrainConfig, start: int, console) -> None:
    """Refuse a run whose first save cannot fit on the checkpoint disk; warn if a later one cannot.

    Raises:
      ConfigError: not even one save fits in the free space.
    """
    plan = ckpt_lib.plan_disk(ckpt.directory, uncompressed_bytes=ckpt.per_save_bytes,
                              keep=train.max_num_checkpoints_to_keep, period=train.checkpoint_period,
                              start=start, steps=train.steps)
    if error := plan.error():
        raise ConfigError(error)
    if warning := plan.warning():
        console.print(warning, style="yellow", markup=False, soft_wrap=True)


def _random_state(s: _Setup) -> dict:
    """The step-0 train state with parameters drawn from the seed, on the mesh."""
    return jax.jit(s.init, out_shardings=s.shardings)()


def _start_state(s: _Setup, train: TrainConfig) -> dict:
    """The step-0 train state, its params and router bias from load_parameters_path /
    hf_model_path if set, else random.

    Loaded parameters are never preceded by a random initialisation (for a large
    model that was a second copy on device and its startup time): the optimizer
    state and counters are built around them.
    """
    if not (train.load_parameters_path or train.hf_model_path):
        return _random_state(s)
    keys = ("params", "router_bias")
    loaded = ckpt_lib.initial_parameters(
        s.model, train, {k: s.abstract[k] for k in keys}, {k: s.shardings[k] for k in keys})
    rest = jax.jit(functools.partial(step_lib.optimizer_start, s.tx),
                   out_shardings={k: v for k, v in s.shardings.items() if k not in keys})
    return {**loaded, **rest(loaded["params"])}


def _tokens_per_step(s: _Setup, train: TrainConfig) -> int:
    return s.global_batch * train.max_target_length * train.gradient_accumulation_steps


def _describe(console, model: ModelConfig, train: TrainConfig, s: _Setup, run_dir: str):
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(s.abstract["params"]))
    tokens = _tokens_per_step(s, train)
    console.print(
        f"[bold]dropless train[/bold] -> {run_dir}\n"
        f"  model: {num_params / 1e6:,.2f}M params, {model.num_decoder_layers} layers "
        f"({model.first_num_dense_layers} dense), {model.moe.num_experts} experts top-"
        f"{model.moe.num_experts_per_tok}, mtp {model.mtp_num_layers}, remat {model.remat_policy}\n"
        f"  mesh: {dict(s.mesh.shape)} on {jax.devices()[0].device_kind}; batch {s.global_batch} x "
        f"{train.max_target_length} x {train.gradient_accumulation_steps} accum = {tokens:,} tokens/step; "
        f"{s.flops.total:.4g} TFLOP/step/device\n"
        f"  data: {s.source.description}"
    )
    if s.source.entropy_floor is not None:
        console.print(f"  data entropy (loss floor): {s.source.entropy_floor:.4f} nats/token")
    kept_bf16 = bf16_dense_matmuls_line(model)  # FP8 asked for, some matmuls not in it: say so
    if kept_bf16:
        console.print(f"  {kept_bf16}", style="yellow", markup=False, soft_wrap=True)
    rows = moe_lib.rows_per_local_expert(model.moe, s.global_batch * train.max_target_length
                                         / s.mesh.size, dict(s.mesh.shape).get("expert", 1))
    if few_rows := moe_lib.fp8_rows_line(model.moe, rows):  # FP8 that cannot pay here: say so
        console.print(f"  {few_rows}", style="yellow", markup=False, soft_wrap=True)
    # The expert weights' codes made once per step by the trainer (as --dry-run counts them).
    given = memory_lib.fp8_weight_codes_bytes(model, s.abstract["params"],
                                              train.gradient_accumulation_steps,
                                              dict(s.mesh.shape)) > 0
    if recomputed := remat_lib.fp8_codes_recomputed_line(model, given):  # custom remat re-quantizing
        console.print(f"  {recomputed}", style="yellow", markup=False, soft_wrap=True)
    return num_params, tokens


def _jit_step(s: _Setup):
    """The jitted train step: state sharded as ``s.shardings`` and donated."""
    return jax.jit(
        step_lib.make_train_step(s.graphdef, s.model, s.tx, s.schedule),
        in_shardings=(s.shardings, s.feed.sharding),
        out_shardings=(s.shardings, None),
        donate_argnums=0,
    )


class Built(NamedTuple):
    """A trainer ready to step: what ``build`` returns.

    state: freshly initialised train state (``train.step``), on the mesh.
    step_fn: jitted ``(state, batch) -> (state, metrics)``; donates ``state``.
    batches: endless iterator of device-ready batches from step 0.
    tflops_per_step: analytic TFLOPs per device per step (``train.flops``).
    global_batch: sequences per microbatch over all devices.
    entropy_floor: the data's loss floor in nats/token, or None.
    run: ``(state, console=None) -> ran``: the trainer's own step loop over steps
      0..``train.steps``-1 from ``state`` (donated), with no checkpoints and no
      files; ``ran.rows`` are the metrics rows ``metrics.jsonl`` would hold,
      ``ran.windows`` the timing windows (``metrics.median_step_time``).
    """

    state: dict
    step_fn: object
    batches: Iterator
    tflops_per_step: float
    global_batch: int
    entropy_floor: float | None
    run: object


def build(model: ModelConfig, train: TrainConfig, mesh: MeshConfig) -> Built:
    """The trainer's state, jitted step and batch stream, without running or checkpointing.

    The parameters come from ``load_parameters_path`` or ``hf_model_path`` when set.

    For benchmarks and profiling; ``run_training`` uses the same parts.

    Raises:
      ValueError / FileNotFoundError: as ``run_training``.
    """
    user_errors.check_platform(model)
    s = _setup(model, train, mesh)
    batches = (s.feed(i) for i in itertools.count())
    state = _start_state(s, train)
    return Built(state, _jit_step(s), batches, s.flops.total, s.global_batch, s.source.entropy_floor,
                 functools.partial(_run_steps, s, train))


class _Ran(NamedTuple):
    """What ``_train_steps`` ran: final state, metrics rows, timings, summed expert load."""

    state: dict
    rows: list
    windows: list  # (mean seconds per step, steps) of each timing window (metrics.StepWindows)
    load_LE: np.ndarray | None
    compile_s: float | None
    saves: list  # checkpoint.SaveTiming of each save this invocation made


# At most this many steps per timing window. A window's end waits for its last
# step before dispatching the next, which leaves the device idle for one dispatch
# (about a millisecond against steps of hundreds); every other step's metrics are
# fetched one step late and never make the host wait.
TIMING_WINDOW_STEPS = 10

_clock = time.perf_counter  # the loop's clock and its wait for a step (tests replace both)


def _clock_sampler():
    """NVML sampling of this process's first GPU over each timing window (``perf.clocks``),
    or None off GPUs. A sustained step runs at the board's power limit, below the rated
    clock; the rows say at which clock and power each window ran (tests replace this)."""
    device = jax.local_devices()[0]
    if device.platform != "gpu":
        return None
    return clocks_lib.ClockSampler(getattr(device, "local_hardware_id", None) or 0, interval_s=0.2)


def _window_clocks(clocks) -> dict:
    """The row fields of the window just closed: median SM clock and power, when sampled."""
    if clocks is None:
        return {}
    clocks.stop("window")
    summary = clocks.summary("window")
    if not summary.get("available"):
        return {}
    fields = {"gpu_sm_mhz": summary["sm_mhz_median"], "gpu_power_w": summary["power_w_median"]}
    return {k: float(v) for k, v in fields.items() if v is not None}


def _fetch(raw_device):
    """Host copy of a step's metrics, once that step has finished on every local device."""
    return jax.device_get(jax.block_until_ready(raw_device))


def _ready(raw_device) -> bool:
    """Whether a step's metrics are computed, without waiting or copying anything."""
    return all(x.is_ready() for x in jax.tree.leaves(raw_device) if isinstance(x, jax.Array))


def _save(ckpt, step_no, state, force, console):
    """Save if due; returns the save's timing (None if not due), warning when it waited."""
    if not ckpt.save(step_no, state, force=force):
        return None
    timing = ckpt.last_timing
    if timing.wait_s > 1.0:
        console.print(f"checkpoint at step {step_no} waited {timing.wait_s:.1f} s for the previous "
                      "save to finish writing: raise checkpoint_period or use faster storage",
                      style="yellow", markup=False)
    return timing


def _memory_limit(device) -> int | None:
    """Bytes JAX may use on ``device`` (its allocator's limit), or None where it reports none (CPU)."""
    return (device.memory_stats() or {}).get("bytes_limit")


def _check_snapshot_room(step_fn, state, batch) -> None:
    """Refuse ``checkpoint_device_snapshot`` where a second copy of the state would not fit beside the step.

    Compiles ``step_fn`` for ``state`` and ``batch`` (the first step's call then
    reuses it) and adds the most state bytes any local device holds to XLA's
    peak for the step (``perf.memory.compiled_bytes``): while Orbax copies a
    snapshot to the host the steps go on beside it. Compared with each local
    device's allocator limit; devices that report none (CPU) are not checked.
    The allocator's fragmentation is not modelled.

    Raises:
      ConfigError: the copy would not fit, in one line naming the key.
    """
    from dropless.perf import memory

    limits = {d: _memory_limit(d) for d in jax.local_devices()}
    limits = {d: v for d, v in limits.items() if v}
    if not limits:
        return
    peak = memory.compiled_bytes(step_fn.lower(state, batch).compile()).get("peak")
    if peak is None:
        return
    copy = ckpt_lib.state_bytes_per_device(state)
    device, limit = min(limits.items(), key=lambda kv: kv[1])
    if peak + copy > limit:
        gib = ckpt_lib.GiB
        raise ConfigError(
            f"checkpoint_device_snapshot=true: a copy of the train state ({copy / gib:.2f} GiB per device) "
            f"does not fit beside the train step (XLA's peak {peak / gib:.2f} GiB) in the {limit / gib:.2f} GiB "
            f"JAX may use on {device.device_kind}; set checkpoint_device_snapshot=false, or make room "
            "(more devices, a smaller per_device_batch_size, or a larger XLA_PYTHON_CLIENT_MEM_FRACTION)")


def _plan_warmup(s: _Setup, train: TrainConfig, ckpt, console):
    """The pinned host memory warm-up (``host_pool``), not yet started; None when off or
    of no use (said in one line when asked for with ``true``; ``auto`` is silent). The loop
    starts it in quiet steps (``_quiet_steps``)."""
    asked = train.checkpoint_warm_host_memory
    if asked is False:
        return None
    reason = "checkpointing is off" if ckpt is None else host_pool.skip_reason(
        async_save=train.async_checkpointing)
    if reason is not None:
        if asked is True:
            console.print(f"checkpoint_warm_host_memory: skipped: {reason}", style="yellow", markup=False)
        return None
    return host_pool.HostPoolWarmup(s.abstract, s.shardings)


# Quiet steps: how many steps' batches go on the device before the warm-up starts,
# as a multiple of the steps its estimated time spans, and at most how many bytes
# of batches (a few MiB for the proxy's 150-odd steps).
QUIET_MARGIN = 1.5
QUIET_MAX_BYTES = 2**30


def _quiet_steps(estimate_s: float, step_s: float, steps_left: int, batch_bytes: int) -> int:
    """How many steps run quiet (no host transfer) while the warm-up pins memory: enough
    for ``QUIET_MARGIN`` times its estimated span at ``step_s`` per step, within the
    steps left and ``QUIET_MAX_BYTES`` of staged batches; at least 1. Should the
    warm-up outlast them, the loop waits for it after the last (reported)."""
    want = math.ceil(QUIET_MARGIN * estimate_s / max(step_s, 1e-6))
    return max(1, min(want, steps_left, QUIET_MAX_BYTES // max(batch_bytes, 1)))


def _report_warmup(warm, console):
    """Print the warm-up's line the first time it is asked after the warm-up ended; returns its result, else None."""
    if warm is None or (warmed := warm.report()) is None:
        return None
    console.print(warmed.line(), markup=False, soft_wrap=True)
    return warmed


def _train_steps(s: _Setup, train: TrainConfig, state, start, ckpt, writer, console, tokens,
                 preempt=None) -> _Ran:
    """Run steps start..steps-1.

    Step times are window means (``metrics.StepWindows``). A window ends at the
    first step of this invocation (it compiles: its time is ``compile_s``, in no
    window), every ``TIMING_WINDOW_STEPS``-th and every printed step, a save's
    step and the last step. There the loop waits for that step and opens the
    next window; the row, with the window's mean, is written while the next
    step runs, except at a save (row, then save, then the next window opens)
    and at the last step. Other rows are written one step late, without
    timing. A save's blocking time is in no step time: it is reported on the
    next row (``checkpoint_wait_s``, ``checkpoint_blocked_s``).

    ``preempt``: a ``preemption.Watch`` or None. Where its ``reached`` is true
    the step just dispatched is the last: its row is written, it is saved
    (forced), the save is waited for until written and sealed, and
    ``preemption.Preempted`` is raised.

    Raises:
      preemption.Preempted: as above.
    """
    step_fn = _jit_step(s)
    rows, saves, load_LE, first_step_s = [], [], None, None
    pending, unreported = None, None
    timer = metrics_lib.StepWindows(_clock)
    monitor = _overflow_monitor(s, console)
    clocks = _clock_sampler()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="data") as pool, \
            metrics_lib.ProgressDisplay(console, train.steps, start) as progress, \
            contextlib.ExitStack() as cleanup:
        if clocks is not None and cleanup.enter_context(clocks).unavailable is not None:
            console.print(f"metrics: no GPU clock or power in the rows ({clocks.unavailable})",
                          markup=False)
        future = pool.submit(s.feed.local, start)
        warm = _plan_warmup(s, train, ckpt, console)
        if warm is not None:  # its thread holds jax arrays: it ends before the loop does
            cleanup.callback(warm.wait)
        staged = collections.deque()  # device batches of the quiet steps to come
        quiet_rows = []  # (step, metrics on device) of the quiet steps, written when they end
        if start < train.steps:  # the progress bar is not drawn in a log: say what the wait is
            console.print(f"step {start + 1}: compiling the train step (its row gives compile_s) ...",
                          markup=False)
        t_start = _clock()
        opened = start  # steps done when the current window opened

        def finish(step_no, raw, *, fetched=False, step_time=None, timed=1, compile_s=None,
                   warm_held_s=0.0, gpu=None):
            """Write ``step_no``'s row: ``raw`` on device, or on the host if ``fetched``;
            ``step_time`` the mean over the ``timed`` steps of the window it ends;
            ``compile_s`` on the compiling first step's row; the warm-up's result once it
            ended; ``warm_held_s`` the loop's wait for it at the end of the quiet steps;
            ``gpu`` the window's clock and power (``_window_clocks``)."""
            nonlocal load_LE, unreported
            if not fetched:
                raw = _fetch(raw)
            row = metrics_lib.make_row(
                step_no, raw, step_time=step_time, timed_steps=timed, tokens_per_step=tokens,
                num_devices=s.mesh.size, tflops_per_step=s.flops.total, peak_tflops=s.peak,
            )
            if compile_s is not None:
                row["compile_s"] = compile_s
            row.update(gpu or {})
            if warm_held_s:
                row["checkpoint_warm_held_s"] = warm_held_s
            if unreported is not None and unreported.step < step_no:
                row.update(checkpoint_wait_s=unreported.wait_s, checkpoint_blocked_s=unreported.blocked_s)
                unreported = None
            if ckpt is not None and (handed := ckpt.take_handoff_seconds()) is not None:
                row["checkpoint_background_s"] = handed[1]
            if (warmed := _report_warmup(warm, console)) is not None and warmed.error is None:
                row.update(checkpoint_warm_s=warmed.seconds, checkpoint_warm_gib=warmed.nbytes / ckpt_lib.GiB)
            if "tokens_per_expert" in raw:
                tpe = np.asarray(raw["tokens_per_expert"], np.int64)
                load_LE = tpe if load_LE is None else load_LE + tpe
            rows.append(row)
            writer.write(row)
            progress.update(row)
            if monitor is not None:
                monitor.record(step_no, raw["overflow_tokens"], raw["buffer_factor_needed"])

        def put_batch(step_no):
            """Step ``step_no``'s batch on the device; the next one starts on the data thread."""
            nonlocal future
            batch = s.feed.put(future.result())
            if step_no + 1 < train.steps:
                future = pool.submit(s.feed.local, step_no + 1)
            return batch

        def stage(first, n):
            """Put the batches of steps first..first+n-1 on the device, ready, for the quiet steps."""
            staged.extend(put_batch(step_no) for step_no in range(first, first + n))
            jax.block_until_ready(list(staged))

        def start_quiet(done, step_s):
            """Stage the next steps' batches, then start the warm-up: until it ends the
            loop neither puts nor fetches (its small copies would wait for the pinning)."""
            batch_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(batch))
            n = _quiet_steps(warm.estimate_s(), step_s, train.steps - done, batch_bytes)
            t0 = _clock()
            stage(done, n)  # the device idles meanwhile: said below
            steps = f"step {done + 1}" if n == 1 else f"steps {done + 1}-{done + n}"
            console.print(
                f"checkpoint: pinning {warm.nbytes / ckpt_lib.GiB:.2f} GiB of host memory for the first "
                f"save (about {warm.estimate_s():.0f} s); {steps} run from batches put on the device "
                f"beforehand (in {_clock() - t0:.1f} s), and their rows follow when it ends", markup=False)
            warm.start()

        def end_quiet(done, raw):
            """Wait for a warm-up still running, then write the held-back rows. Returns the
            host's wait; said in a line if the device may have idled in it (step ``done``,
            whose metrics are ``raw``, had finished by the end of the wait)."""
            held = warm.wait()
            if held >= 0.1 and _ready(raw):
                console.print(f"checkpoint: the host memory warm-up outlasted the quiet steps: the device "
                              f"may have idled up to {held:.1f} s after step {done}", style="yellow",
                              markup=False)
            for step_no, raw_q in quiet_rows:
                finish(step_no, raw_q)
            quiet_rows.clear()
            return held

        quiet, warm_held = False, 0.0
        for step in range(start, train.steps):
            batch = staged.popleft() if staged else put_batch(step)
            if step == start and ckpt is not None and ckpt.device_snapshot:
                _check_snapshot_room(step_fn, state, batch)
            state, raw = step_fn(state, batch)
            if pending is not None:
                pending()
                pending = None
            done = step + 1
            last = done == train.steps
            stop = preempt is not None and preempt.reached(done)
            saving = ckpt is not None and ckpt.due(done, force=last or stop)
            if quiet:
                if staged and warm.running() and not (last or saving or stop):
                    quiet_rows.append((done, raw))  # no fetch: it would wait for the pinning
                    if ckpt is not None:
                        ckpt.poll()
                    continue
                quiet = False  # ends here, with this step's window
                warm_held = end_quiet(done, raw)
            elif not (done == start + 1 or last or saving or stop or done % TIMING_WINDOW_STEPS == 0
                      or progress.prints(done)):
                pending = functools.partial(finish, done, raw)
                if ckpt is not None:
                    ckpt.poll()
                continue
            raw = _fetch(raw)  # the window's last step has finished
            if done == start + 1:
                first_step_s = _clock() - t_start
                if preempt is not None:
                    preempt.first_step_done()
                pending = functools.partial(finish, done, raw, fetched=True, compile_s=first_step_s)
            else:
                step_s = timer.close(done - opened)
                pending = functools.partial(finish, done, raw, fetched=True, step_time=step_s,
                                            timed=done - opened, warm_held_s=warm_held,
                                            gpu=_window_clocks(clocks))
                warm_held = 0.0
            if saving or last or stop:
                pending()  # a saved step's row first: nothing can kill the run before it
                pending = None
                if saving:
                    save = _save(ckpt, done, state, last or stop, console)
                    if save is not None:
                        saves.append(save)
                        unreported = save
                if stop:
                    if ckpt is not None:
                        ckpt.wait()  # written and sealed: the exit must not cut the async save off
                    raise preemption.Preempted(done)
            # else the row is written while the next step runs
            if ckpt is not None:
                ckpt.poll()
            if (warm is not None and not warm.started and not saves and done > start + 1
                    and not (last or stop)):
                start_quiet(done, step_s)  # after the first timed window, before the window opens
                quiet = True
            opened = done
            if clocks is not None:
                clocks.reset()  # only the window's samples are kept
                clocks.start("window")
            timer.open()
    _report_warmup(warm, console)  # if it ended after the last row
    if monitor is not None and rows:
        monitor.check(rows[-1]["step"])  # what the last periodic check did not cover
    return _Ran(state, rows, timer.windows, load_LE, first_step_s, saves)


def _run_steps(s: _Setup, train: TrainConfig, state, console: Console | None = None) -> _Ran:
    """``_train_steps`` from step 0 with no checkpoints and no files (``Built.run``)."""
    console = console or Console()
    no_files = types.SimpleNamespace(write=lambda row: None)
    return _train_steps(s, train, state, 0, None, no_files, console, _tokens_per_step(s, train))


def _overflow_monitor(s: _Setup, console):
    """The expert-parallel overflow policy (``parallel.overflow``), or None without MoE layers."""
    names = moe_layer_names(s.model)
    if not names:
        return None
    return overflow_lib.OverflowMonitor(
        every_n_steps=s.mesh_cfg.ep_overflow_check_every_n_steps,
        policy=s.mesh_cfg.ep_overflow_policy,
        buffer_factor=s.mesh_cfg.ragged_buffer_factor,
        layer_names=names,
        warn=lambda msg: console.print(msg, style="yellow", markup=False),
    )


def _result(s: _Setup, run_dir, writer, rows_all, ran: _Ran, resumed_from, num_params,
            tokens, t0, plot_path) -> TrainResult:
    last = rows_all[-1] if rows_all else None
    step_time = metrics_lib.median_step_time(ran.windows)
    return TrainResult(
        ok=bool(last) and math.isfinite(last["loss"]) and last["skipped_steps"] < last["step"],
        run_dir=run_dir,
        steps_run=len(ran.rows),
        final_step=last["step"] if last else (resumed_from or 0),
        resumed_from=resumed_from,
        initial_loss=rows_all[0]["loss"] if rows_all else None,
        final_loss=last["loss"] if last else None,
        final_lm_loss_avg=metrics_lib.final_lm_loss(rows_all),
        entropy_floor=s.source.entropy_floor,
        skipped_steps=last["skipped_steps"] if last else 0,
        num_params=num_params,
        step_time_s=step_time,
        tokens_per_s=tokens / step_time if step_time else None,
        tflops_per_device=s.flops.total / step_time if step_time else None,
        mfu=s.flops.total / step_time / s.peak if step_time and s.peak else None,
        compile_s=ran.compile_s,
        wall_s=time.perf_counter() - t0,
        metrics_path=writer.jsonl_path,
        plot_path=plot_path,
        checkpoint_saves=len(ran.saves),
        checkpoint_blocked_s=sum(t.blocked_s for t in ran.saves),
        checkpoint_first_blocked_s=ran.saves[0].blocked_s if ran.saves else None,
    )


def _print_summary(console, r: TrainResult):
    fields = {
        "steps": f"{r.final_step} ({r.steps_run} this run"
                 + (f", resumed from {r.resumed_from})" if r.resumed_from is not None else ")"),
        "initial loss": r.initial_loss,
        "final loss": r.final_loss,
        "final LM loss (mean of last 10%)": r.final_lm_loss_avg,
        "data entropy (floor)": r.entropy_floor,
        "gap to floor": (r.final_lm_loss_avg - r.entropy_floor)
        if r.entropy_floor is not None and r.final_lm_loss_avg is not None else None,
        "skipped steps (non-finite or EP overflow)": r.skipped_steps,
        "parameters": f"{r.num_params:,}",
        "compile + first step (s)": r.compile_s,
        "step time (s, median over steps of window means)": r.step_time_s,
        "tokens/s": r.tokens_per_s,
        "TFLOP/s per device": r.tflops_per_device,
        "MFU": r.mfu,
        "wall time (s)": r.wall_s,
        "checkpoint saves (count; s blocking the loop, % of wall)":
            f"{r.checkpoint_saves}; {r.checkpoint_blocked_s:.2f} s, {100 * r.checkpoint_blocked_s / r.wall_s:.1f}%"
            if r.checkpoint_saves else None,
        "run directory": r.run_dir,
        "plot": r.plot_path,
        "record": r.record_path,
    }
    console.print(metrics_lib.summary_table(fields))


def write_run_record(result: TrainResult, sections: dict, tflop_per_step: float,
                     peak_tflops: float | None) -> str:
    """The run's provenance record, as the benchmarks write theirs: ``<run_dir>/records/
    train-<time>-<gpu>.json`` with the device, jax version, commit (``DROPLESS_COMMIT``
    or git), the config sections and the summary. One per invocation (a resume adds one)."""
    from dropless.perf import measure

    record = measure.new_record("train", sections)
    record.update(dataclasses.asdict(result), tflop_per_step_device=tflop_per_step,
                  peak_tflops=peak_tflops)
    record.pop("record_path", None)
    return str(measure.write_record(record, os.path.join(result.run_dir, "records")))


class TrainingInterrupted(Exception):
    """Ctrl-C stopped the steps; the message (one line) names the last recorded step
    and the checkpoint the same command resumes from."""


class TrainingPreempted(Exception):
    """SIGTERM stopped the steps (``preemption``); the message (one line) names the step
    saved and what resumes from it."""


def _same_command(train: TrainConfig, run_dir: str) -> str:
    return ("the same command" if train.run_name
            else f"the same command with run_name={os.path.basename(run_dir)}")


def _resume_clause(train: TrainConfig, run_dir: str) -> str:
    """What resumes the run from its newest complete checkpoint, or that nothing can."""
    again = _same_command(train, run_dir)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    saved = ckpt_lib.complete_steps_in(ckpt_dir) if train.enable_checkpointing else []
    if saved:
        return f"checkpoint {os.path.join(ckpt_dir, str(saved[-1]))} is the newest; {again} resumes from step {saved[-1]}"
    if train.enable_checkpointing:
        return (f"no checkpoint saved yet (checkpoint_period={train.checkpoint_period}): "
                f"{again} starts again from the beginning")
    return "nothing to resume from (enable_checkpointing=false)"


def _interrupted_message(train: TrainConfig, run_dir: str, jsonl_path: str) -> str:
    rows = metrics_lib.read_jsonl(jsonl_path)  # process 0's; the others say "before step 1"
    where = f"after step {rows[-1]['step']} of {train.steps}" if rows else "before step 1 finished"
    return f"interrupted {where}; run directory {run_dir}; {_resume_clause(train, run_dir)}"


def _preempted_message(train: TrainConfig, run_dir: str, step: int) -> str:
    """The line of a run stopped by SIGTERM after ``step``, that step saved if checkpointing is on."""
    where = f"preempted (SIGTERM) after step {step} of {train.steps}"
    if not train.enable_checkpointing:
        return (f"{where}; nothing saved (enable_checkpointing=false): {_same_command(train, run_dir)} "
                f"starts again from the beginning; run directory {run_dir}")
    step_dir = os.path.join(run_dir, "checkpoints", str(step))
    then = ("the run is complete" if step == train.steps
            else f"{_same_command(train, run_dir)} resumes from step {step}")
    return f"{where}; saved checkpoint {step_dir}; {then}"


def _preempted_at_once_message(train: TrainConfig, run_dir: str, start: int,
                               stopping_at: int | None) -> str:
    """The line of a SIGTERM that ends the process at once (``preemption.Watch``'s ``at_once_line``)."""
    if stopping_at is None:
        what = f"preempted (SIGTERM) before step {start + 1} finished (compiling); nothing to save"
    elif stopping_at == 0:
        what = "preempted by a second SIGTERM before the step in progress finished; it is not saved"
    elif train.enable_checkpointing and stopping_at not in ckpt_lib.complete_steps_in(
            os.path.join(run_dir, "checkpoints")):
        what = (f"preempted by a second SIGTERM while saving step {stopping_at}: that save was still in "
                "progress and is not used")
    else:
        what = f"preempted by a second SIGTERM after step {stopping_at}"
    return f"{what}; {_resume_clause(train, run_dir)}"


def run_training(model: ModelConfig, train: TrainConfig, mesh: MeshConfig, *,
                 console: Console | None = None) -> TrainResult:
    """Train ``model`` as ``train`` says on a mesh of all devices; see the module docstring.

    Returns:
      TrainResult (also printed as a table).

    Raises:
      ConfigError (a ValueError, one line): data or tokenizer problems, kernels
        the device cannot run, an unwritable run directory, a resume with a
        changed config, device memory exhausted (naming the keys to lower).
      ValueError: other bad configuration.
      CheckpointError: the checkpoint to resume or load is corrupt or does not fit.
      CheckpointSaveError: a save failed (e.g. the disk is full); the checkpoints
        before it are intact and the message names the one to resume from.
      parallel.overflow.EPOverflowError: an expert-parallel buffer overflowed
        under ``ep_overflow_policy="error"`` (checkpoints so far are kept).
      TrainingInterrupted: Ctrl-C (SIGINT) during the steps, after the save in
        flight finished; its one line says where the run stopped and what resumes it.
      TrainingPreempted: SIGTERM during the steps (``preemption``): the step in
        progress was finished, saved and its save written; one line names it.
        (A SIGTERM during the first step's compile, or a second one, ends the
        process at once with one line and exit code 143.)
    """
    t0 = time.perf_counter()
    console = console or Console()
    primary = jax.process_index() == 0
    user_errors.check_platform(model)  # not in _setup: a dry run sets up for another machine
    s = _setup(model, train, mesh)
    if not train.run_name and jax.process_count() > 1:
        raise ConfigError("run_name is empty: a multi-process run needs one, so every process uses one directory")
    if train.enable_checkpointing and train.checkpoint_device_snapshot and jax.process_count() > 1:
        raise ConfigError(f"checkpoint_device_snapshot=true runs on one process only ({jax.process_count()} here): "
                          "Orbax's save synchronises the processes with a collective that, launched from a background "
                          "thread between the steps' collectives, could run in another order on each process and "
                          "hang; set checkpoint_device_snapshot=false")
    run_name = train.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = run_dir_lib.make_run_dir(train.base_output_directory, run_name)
    sections = run_dir_lib.sections_dict(model, train, mesh)
    run_dir_lib.record_config(
        run_dir, sections, primary=primary,
        allow_change=train.allow_config_change_on_resume,
        say=lambda msg: console.print(msg, style="yellow", markup=False),
    )
    num_params, tokens = _describe(console, model, train, s, run_dir)
    ckpt, interrupted, preempted = None, False, None
    if train.enable_checkpointing:
        ckpt = ckpt_lib.Checkpointer(
            os.path.join(run_dir, "checkpoints"), period=train.checkpoint_period,
            async_save=train.async_checkpointing, max_to_keep=train.max_num_checkpoints_to_keep,
            per_save_bytes=ckpt_lib.save_bytes(s.abstract),
            pinned_host_transfer=train.checkpoint_pinned_host_transfer,
            device_snapshot=train.checkpoint_device_snapshot,
        )
    try:
        state, resumed_from = _initial_state(s, train, ckpt, console)
        start = int(jax.device_get(state["step"]))
        writer = metrics_lib.MetricsWriter(run_dir, enable_tensorboard=train.enable_tensorboard,
                                           resume_step=start, log_period=train.log_period,
                                           enabled=primary)
        if start >= train.steps:
            console.print(f"run already complete at step {start} (steps={train.steps})")
        at_once = functools.partial(_preempted_at_once_message, train, run_dir, start)
        try:
            with user_errors.memory_errors(model, train), preemption.watch(
                    start=start, at_once_line=at_once,
                    say=lambda msg: console.print(msg, style="yellow", markup=False)) as preempt:
                ran = _train_steps(s, train, state, start, ckpt, writer, console, tokens, preempt)
        except KeyboardInterrupt:
            interrupted = True
        except preemption.Preempted as e:
            preempted = e.step
        finally:
            writer.close()
    finally:
        if ckpt is not None:
            ckpt.close()  # a save in flight is finished first, interrupted or not
    if interrupted:
        raise TrainingInterrupted(_interrupted_message(train, run_dir, writer.jsonl_path))
    if preempted is not None:
        raise TrainingPreempted(_preempted_message(train, run_dir, preempted))
    # Process 0 writes the run's files; the others report what they ran.
    rows_all = metrics_lib.read_jsonl(writer.jsonl_path) if primary else ran.rows
    plot_path = None
    if rows_all and primary:
        plot_path = plots.plot_run(
            rows_all, os.path.join(run_dir, "summary.png"), entropy_floor=s.source.entropy_floor,
            load_LE=ran.load_LE, title=f"{run_name}: {s.source.description}",
        )
    result = _result(s, run_dir, writer, rows_all, ran, resumed_from, num_params, tokens, t0,
                     plot_path)
    if primary:
        result = dataclasses.replace(result, record_path=write_run_record(
            result, sections, s.flops.total, s.peak))
    _print_summary(console, result)
    return result
