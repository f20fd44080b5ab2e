"""``dropless train --dry-run`` (and ``profile --dry-run``): check a job without running it.

    python -m dropless train --dry-run [--device h200] [--devices N] [--memory-gib G]
        [--compile | --compile-for h200] [config.yml] key=value ...

Resolves the config as ``train`` does, builds the data source and this
device's part of the first batch, builds the model and train state
abstractly (``eval_shape``) and prints a per-device memory estimate for the
target hardware (``perf.memory``): parameters, gradients, optimizer state,
the state's copy of ``checkpoint_device_snapshot``, activations under the
remat/offload policy, and the checkpoint size, and, as
``train`` does at start, the dense matmuls that ``fp8_min_dim`` keeps in bf16
under FP8 (``nn.model.bf16_dense_matmuls_line``). Nothing is trained and no run directory is written. With checkpointing on, it also
checks the free space on this machine's filesystem holding the run's
checkpoint directory against the saves the run makes (as ``train`` does
before its first step): too small for all that are on disk at once
(``max_num_checkpoints_to_keep`` + 1) warns; too small for one save exits 2
when the dry run is for this machine (no ``--device``, ``--devices`` or
``--memory-gib``, or ``--compile``) and warns when it describes another; so
do a run directory that cannot be made under ``base_output_directory`` and a
``load_parameters_path`` that is not there (``train`` stops on both at once).

The target is ``--device`` (h100, h200, b200, cpu), by default h200 for
``hardware=gpu``/``gpu_multiprocess`` (or ``auto`` with a GPU present) and
this machine's memory for CPU; ``--devices`` is the device count the mesh
fills (default: the product of the fixed ``ici_*`` axes, at least 1). It runs
on CPU whatever ``hardware`` says. ``--compile`` instead starts the real
runtime, compiles the train step for the devices present and prints XLA's
memory analysis next to the estimate (use it on the target GPU).
``--compile-for h200`` does the same for H200s on a machine without one: the
trainer's step compiled by jax's CUDA plugin for the device its target config
describes (``perf.gpu_compile``; run from ``.venv-gpucompile``, ``make
gpu-compile-venv``), checked against the H200's usable memory. On
deepseek3-proxy under ``remat_policy: minimal`` it gave 60.12 GiB (41.1 of state, 19.0
of XLA's temporaries) where the H200 measured a 60.10 GiB peak
(``step-20261206-035133``, ``ours``); under the preset's ``minimal_with_context`` 61.63
against 61.61 (``step-20261206-215959``, ``ours_ctx``), and 59.40 since the loss's
backward is one pass (``ops.cross_entropy``; not yet measured).
With ``--devices N`` (one host: at most 8) the mesh spans N compile-only H200s, the
peak is per device, and a line counts the step's collectives (expert parallelism's
all-to-alls, the gradient reductions), each with how many of its runs are
asynchronous, which XLA can overlap with compute.

Exit codes: 0 fits; 2 a config, data or model problem, an estimate over
the usable memory, or (for this machine) a checkpoint disk without room for
one save, stated in one line that names the keys to change.
"""

import argparse
import math
import os
import sys

EXIT_CONFIG = 2
GiB = 2**30
# --compile-for: the GPUs perf.gpu_compile has a target config of -> the most of them one host
# holds (an HGX H200 board: 8, one NVLink domain).
COMPILE_TARGETS = {"h200": 8}
PROFILE_FLAGS = {"--steps": int, "--warmup": int, "--top": int}


def parse_args(args: list[str], command: str):
    """(namespace, config file and key=value args); profile's own flags are accepted and unused.

    Raises:
      SystemExit: a bad or unknown flag (argparse, exit 2).
    """
    p = argparse.ArgumentParser(prog=f"dropless {command} --dry-run", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="target GPU: h100 | h200 | b200 | cpu")
    p.add_argument("--devices", type=int, default=None, help="devices the mesh spans (default: "
                   "the product of the fixed ici_* axes)")
    p.add_argument("--memory-gib", type=float, default=None, help="device memory, for a GPU not listed")
    p.add_argument("--compile", action="store_true", help="compile the step on the devices present "
                   "and print XLA's memory analysis too")
    p.add_argument("--compile-for", choices=tuple(COMPILE_TARGETS), default=None,
                   help="compile the step for such GPUs on a machine without one (one host of "
                        "--devices of them, default 1; jax's CUDA plugin: make gpu-compile-venv) "
                        "and print XLA's memory analysis and collectives too")
    if command == "profile":
        for flag, kind in PROFILE_FLAGS.items():
            p.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
        p.add_argument("--python-trace", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ns, rest = p.parse_known_args(args)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.devices is not None and ns.devices < 1:
        p.error(f"--devices must be >= 1, got {ns.devices}")
    if ns.compile_for and (ns.compile or ns.device or ns.memory_gib):
        p.error("--compile-for compiles for GPUs of its own kind: leave out --compile, --device "
                "and --memory-gib")
    most = COMPILE_TARGETS.get(ns.compile_for, 0)
    if ns.compile_for and (ns.devices or 1) > most:
        p.error(f"--compile-for {ns.compile_for} compiles for one host of at most {most} GPUs, "
                f"got --devices {ns.devices}")
    return ns, rest


def _default_device(cfg) -> str:
    from dropless.config.xla_flags import targets_gpu

    return "h200" if targets_gpu(cfg.hardware) else "cpu"


def _default_devices(cfg) -> int:
    ways = [getattr(cfg, f"{k}_{a}_parallelism") for k in ("ici", "dcn")
            for a in ("data", "fsdp", "expert", "tensor")]
    return max(1, math.prod(w for w in ways if w > 0))


def _fail(message: str) -> int:
    print(f"dropless: {message}", file=sys.stderr)
    return EXIT_CONFIG


def check_data(cfg, num_devices: int, batch_shards: int):
    """(source, batch) of this device's sequences of step 0; raises ValueError/OSError on bad data."""
    import numpy as np

    from dropless.train import data as data_lib

    global_batch = data_lib.global_batch_size(cfg.per_device_batch_size, num_devices, batch_shards)
    source = data_lib.make_source(cfg.data(), cfg.vocab_size, batch=global_batch,
                                  seq=cfg.max_target_length, accum=cfg.gradient_accumulation_steps)
    batch = source.batch_at(0, np.arange(global_batch // batch_shards))
    top = int(np.max(batch.inputs)) if batch.inputs.size else 0
    if top >= cfg.vocab_size:
        raise ValueError(f"token id {top} >= vocab_size={cfg.vocab_size}")
    return source, batch, global_batch


def _compiled(s):
    """The trainer's jitted step of setup ``s`` (``loop._setup``) compiled for its mesh's devices."""
    import jax

    from dropless.train import loop

    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                         s.abstract, s.shardings)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.feed.sharding),
                         s.feed.local(0))
    return loop._jit_step(s).lower(state, batch).compile()


def compile_step(cfg) -> tuple[dict, int | None]:
    """XLA's memory analysis of the real train step on this machine's devices, and the usable bytes."""
    import jax

    from dropless.perf import memory
    from dropless.train import loop

    compiled = _compiled(loop._setup(cfg.model(), cfg.train(), cfg.mesh()))
    stats = jax.devices()[0].memory_stats() or {}
    return memory.compiled_bytes(compiled), stats.get("bytes_limit")


def compile_for(cfg, name: str, count: int = 1):
    """The real train step compiled for ``count`` ``name`` GPUs of one host on a machine
    without them (``perf.gpu_compile``: the devices and their probes answer as those GPUs'
    while the step is built, the mesh spans them).

    The caller applies the config's XLA flags and environment first, as ``train`` does on a
    GPU (``apply_runtime_settings(cfg.xla_flags, cfg.env, on_gpu=True)``), before anything in
    the process runs XLA: XLA reads ``XLA_FLAGS`` once per process, at its first use, and
    ignores later changes.

    Raises:
      perf.gpu_compile.NoCudaPlugin: jax's CUDA plugin is not installed.
    """
    from dropless.perf import gpu_compile
    from dropless.train import loop

    gpus = gpu_compile.devices(gpu_compile.SPECS / f"{name}.txtpb", count)
    with gpu_compile.gpu_view(gpus):
        return _compiled(loop._setup(cfg.model(), cfg.train(), cfg.mesh()))


def collectives_line(text: str, num_devices: int, name: str) -> str | None:
    """One line of the collectives in the optimized HLO ``text`` of a step over
    ``num_devices`` ``name`` GPUs (``perf.hlo.collectives``), or None for one device: each
    kind's count, how many are asynchronous, and the fewest and the median compute kernels
    XLA scheduled beside one of those (``perf.hlo.overlap``)."""
    import statistics

    from dropless.perf import hlo

    if num_devices < 2:
        return None
    insts = list(hlo.instructions(text))
    counts, beside = hlo.collectives(insts), hlo.overlap(insts)

    def part(kind, n, asynchronous):
        k = beside.get(kind)
        overlap = f"; kernels beside each: min {min(k)}, median {statistics.median(k):g}" if k else ""
        return f"{kind} {n} ({asynchronous} async{overlap})"

    parts = [part(kind, n, asynchronous) for kind, (n, asynchronous) in sorted(counts.items())]
    return (f"collectives per step in XLA's program for {num_devices} {name}: "
            + (", ".join(parts) or "none"))


def check_paths(cfg) -> str | None:
    """Why ``train`` would stop before its first step on a path, in one line, or None: the run
    directory cannot be made under ``base_output_directory`` (checked without writing), or
    ``load_parameters_path`` is not a directory."""
    from dropless.train import checkpoint as ckpt_lib

    run_dir = os.path.abspath(os.path.join(cfg.base_output_directory, cfg.run_name or "run"))
    existing = ckpt_lib.nearest_existing(run_dir)
    problem = ("is not a directory" if not os.path.isdir(existing)
               else None if os.access(existing, os.W_OK | os.X_OK) else "is not writable")
    if problem:
        return (f"base_output_directory={cfg.base_output_directory!r}: cannot write the run directory "
                f"{run_dir} ({existing} {problem}); choose a writable base_output_directory")
    if cfg.load_parameters_path and not os.path.isdir(cfg.load_parameters_path):
        return f"load_parameters_path={cfg.load_parameters_path!r}: no such checkpoint directory"
    return None


def check_checkpoint_disk(cfg, checkpoint_bytes: int) -> tuple[str | None, str | None]:
    """(error, warning) of the run's checkpoint disk (``checkpoint.plan_disk``), each one line or None.

    A run without ``run_name`` starts a fresh directory; one with it resumes
    from the newest complete checkpoint there, as ``train`` would.
    """
    if not cfg.enable_checkpointing:
        return None, None
    from dropless.train import checkpoint as ckpt_lib

    directory = os.path.join(cfg.base_output_directory, cfg.run_name, "checkpoints")
    complete = ckpt_lib.complete_steps_in(directory) if cfg.run_name else []
    plan = ckpt_lib.plan_disk(directory, uncompressed_bytes=checkpoint_bytes,
                              keep=cfg.max_num_checkpoints_to_keep, period=cfg.checkpoint_period,
                              start=complete[-1] if complete else 0, steps=cfg.steps,
                              fresh=not cfg.run_name)
    return plan.error(), plan.warning()


def print_report(console, cfg, target, est, source, batch, global_batch, compiled=None):
    from rich.table import Table

    from dropless.nn import moe
    from dropless.nn.model import bf16_dense_matmuls_line
    from dropless.train import remat

    mesh = " x ".join(f"{a} {n}" for a, n in est.mesh.items() if n > 1) or "1 device"
    table = Table("part", "GiB / device", title=f"{cfg.model_name} on {target.name}: {mesh}")
    snapshot = " + snapshot" if est.snapshot else ""
    for name, nbytes in est.rows():
        table.add_row(name, f"{nbytes / GiB:.2f}")
    table.add_row("estimated peak", f"{est.total / GiB:.2f}", style="bold")
    if est.offloaded_activations:
        table.add_row("offloaded to host (not counted)", f"{est.offloaded_activations / GiB:.2f}")
    if compiled:
        table.add_row(f"XLA compiled peak (argument + output - alias + temp{snapshot})",
                      f"{(compiled['peak'] + est.snapshot) / GiB:.2f}", style="bold")
    table.add_row(f"usable ({target.memory_bytes / GiB:.1f} GiB x {target.mem_fraction:g})",
                  f"{target.usable_bytes / GiB:.2f}")
    codes = " + FP8 weight codes" if est.fp8_weight_codes else ""
    table.caption = (f"peak = state{snapshot}{codes} + saved activations + max(layer working set, loss-head "
                     "gradient); XLA's temporaries are not modelled (perf/memory.py)")
    console.print(f"data: {source.description}; batch {tuple(batch.inputs.shape)} on this device "
                  f"(global {global_batch} x {cfg.max_target_length} x "
                  f"{cfg.gradient_accumulation_steps} accum)")
    console.print(f"model: {est.num_params / 1e9:.3f}B parameters, {cfg.remat_policy} remat, "
                  f"{est.per_device_batch} sequences per device")
    model = cfg.model()
    kept_bf16 = bf16_dense_matmuls_line(model)
    if kept_bf16:
        console.print(kept_bf16, style="yellow", markup=False, soft_wrap=True)
    rows = moe.rows_per_local_expert(model.moe, est.per_device_batch * cfg.max_target_length,
                                     est.mesh.get("expert", 1))
    if few_rows := moe.fp8_rows_line(model.moe, rows):
        console.print(few_rows, style="yellow", markup=False, soft_wrap=True)
    if recomputed := remat.fp8_codes_recomputed_line(model, est.fp8_weight_codes > 0):
        console.print(recomputed, style="yellow", markup=False, soft_wrap=True)
    console.print(table)
    keep = getattr(cfg, "max_num_checkpoints_to_keep", 0)
    console.print(f"checkpoint: {est.checkpoint_bytes / GiB:.2f} GiB per save (all devices), every "
                  f"{cfg.checkpoint_period} steps" + (f", {keep} kept" if keep else "")
                  + ("" if cfg.enable_checkpointing else " (enable_checkpointing=false: none)")
                  + (f"; checkpoint_device_snapshot: one more copy of the state on each device "
                     f"({est.snapshot / GiB:.2f} GiB, counted above)" if est.snapshot else ""))


def main(args: list[str], command: str = "train") -> int:
    """Entry point of ``dropless {train,profile} --dry-run``; returns the exit code.

    Raises:
      dropless.config.loader.ConfigError: a bad config (the CLI prints it, exit 2).
    """
    ns, rest = parse_args(args, command)
    if not ns.compile:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the estimate needs no accelerator
    if ns.compile_for:
        from dropless.perf import gpu_compile

        if not gpu_compile.plugin_installed():
            return _fail(f"--compile-for {ns.compile_for} needs jax's CUDA plugin, which this Python "
                         "lacks: run `make gpu-compile-venv`, then .venv-gpucompile/bin/python -m "
                         f"dropless {command} --dry-run --compile-for {ns.compile_for} ...")
    from dropless.cli import resolve_args, start_runtime
    from dropless.config.loader import ConfigError
    from dropless.config.schema import ContradictionError, resolve_mesh_shape

    cfg = resolve_args(rest).config
    applied = None
    if ns.compile_for:  # before the estimate below starts XLA, which reads XLA_FLAGS only once
        from dropless.config.xla_flags import apply_runtime_settings

        applied = apply_runtime_settings(cfg.xla_flags, cfg.env, on_gpu=True)
    if ns.compile:
        _, mesh_shape = start_runtime(cfg)
        import jax

        num_devices = jax.device_count()
    else:
        num_devices = ns.devices or _default_devices(cfg)
        try:
            mesh_shape = resolve_mesh_shape(cfg, num_devices, 1)
        except ContradictionError as e:
            raise ConfigError(f"{e.key}={e.value!r}: {e} (--devices {num_devices})") from None
    from rich.console import Console

    from dropless.perf import memory

    try:
        target = memory.target(ns.compile_for or ns.device or _default_device(cfg), cfg.env,
                               ns.memory_gib)
    except ValueError as e:
        return _fail(str(e))
    shards = math.prod(mesh_shape[a] for a in ("data", "fsdp", "expert"))
    try:
        source, batch, global_batch = check_data(cfg, num_devices, shards)
    except (ValueError, OSError) as e:
        return _fail(f"data: {e}")
    try:
        est = memory.estimate(cfg.model(), per_device_batch=global_batch // shards,
                              seq=cfg.max_target_length, accum=cfg.gradient_accumulation_steps,
                              mesh_shape=mesh_shape, optimizer=cfg.optimizer(),
                              device_snapshot=(command == "train" and cfg.enable_checkpointing
                                               and cfg.checkpoint_device_snapshot))
    except ValueError as e:
        return _fail(f"model: {e}")
    compiled = collectives = None
    if ns.compile:
        compiled, limit = compile_step(cfg)
        if limit:
            target = memory.Target(target.name, int(limit), 1.0)
    elif ns.compile_for:
        if num_devices > COMPILE_TARGETS[ns.compile_for]:
            return _fail(f"--compile-for {ns.compile_for} compiles for one host of at most "
                         f"{COMPILE_TARGETS[ns.compile_for]} GPUs; the mesh asks for {num_devices} "
                         "(the fixed ici_*/dcn_* axes); give --devices or smaller axes")
        program = compile_for(cfg, ns.compile_for, num_devices)
        if applied:
            print(f"XLA flags: {' '.join(applied)}")
        compiled = memory.compiled_bytes(program)
        collectives = collectives_line(program.as_text(), num_devices, ns.compile_for)
    console = Console() if sys.stdout.isatty() else Console(width=120)
    print_report(console, cfg, target, est, source, batch, global_batch, compiled)
    if collectives:
        console.print(collectives, markup=False, soft_wrap=True)
    disk_error, disk_warning = check_checkpoint_disk(cfg, est.checkpoint_bytes)
    disk_error = check_paths(cfg) or disk_error
    this_machine = ns.compile or (ns.device, ns.devices, ns.memory_gib, ns.compile_for) == (
        None, None, None, None)
    peak = compiled["peak"] + est.snapshot if compiled else est.total
    over = peak > target.usable_bytes  # the error then: a larger disk alone would not let it run
    if disk_error and this_machine and not over:
        return _fail(disk_error)
    for line in (disk_error, disk_warning):
        if line:
            where = "" if this_machine else " (this machine's disk; the target's may differ)"
            console.print(line + where, style="yellow", markup=False, soft_wrap=True)
    if over:
        keys = memory.keys_to_lower(cfg.model(), est, target.usable_bytes)
        return _fail(f"estimated {peak / GiB:.1f} GiB per device exceeds the "
                     f"{target.usable_bytes / GiB:.1f} GiB usable on {target.name}; lower or change: "
                     + "; ".join(keys))
    console.print(f"fits: {peak / GiB:.1f} of {target.usable_bytes / GiB:.1f} GiB usable "
                  f"({command} --dry-run: nothing was run)")
    return 0
