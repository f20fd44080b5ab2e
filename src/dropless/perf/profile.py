"""``dropless profile [config.yml] key=value ... [--steps N] [--warmup W] [--out DIR]``: where time goes.

``--dry-run`` checks the config, data and memory estimate instead (``perf.dry_run``).

Resolves the config exactly as ``dropless train`` does (same precedence, XLA
flags and environment applied before JAX starts), builds the trainer's state,
jitted step and batches without training, runs ``W`` warm-up steps (compile,
autotune, allocator growth), then captures a ``jax.profiler`` trace of ``N``
steps, each under a ``StepTraceAnnotation``. Written to
``<base_output_directory>/<run_name>/profile/``:

- ``plugins/profile/<time>/*.trace.json.gz`` and ``perfetto_trace.json.gz``
  (open the latter at https://ui.perfetto.dev, or the directory with
  TensorBoard/XProf);
- ``breakdown.json``: kernel time by category (% of kernel time and of wall
  time), the top kernels, the run's config and step time;
- ``breakdown.png``: the categories as a bar chart;
- ``hlo/``: XLA's optimized HLO (``--xla_dump_to``), which names each
  kernel's op and result type even inside CUDA graphs, so that XLA's FP8
  quantize fusions count as quantization (``perf.hlo``).

and a results record (``kind: profile``, ``perf.measure`` provenance) to
``--out DIR`` (default ``benchmarks/results``): the config's key facts
(``precision`` "bf16" or "fp8" from the quantization keys), one row per
kernel category (ms per step per device, % of kernel time, % of wall time),
the step time and TFLOPS/device. ``python -m dropless.perf.report`` renders
the newest bf16 and FP8 records side by side.

The trainer is reached through one function, ``dropless.train.loop.build(
model_cfg, train_cfg, mesh_cfg)``, which must return an object with
``state``, ``step_fn`` (``(state, batch) -> (state, metrics)``, jitted) and
``batches`` (an iterator of device-ready batches), or that triple as a tuple.
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

EXIT_UNAVAILABLE = 1
# The config facts a profile record keeps (what distinguishes one profile from another).
RECORD_KEYS = ("model_name", "quantization", "te_gmm_quantization", "gmm_fp8_impl",
               "gmm_fp8_quantizer", "gmm_fp8_kernel_schedule", "gmm_fp8_fused_swiglu", "gmm_backend", "attention",
               "remat_policy", "dtype", "per_device_batch_size", "max_target_length", "gradient_accumulation_steps")


def parse_args(args: list[str]):
    """Split our flags from the config file and key=value overrides.

    Returns:
      (namespace with steps, warmup, top, python_trace; the remaining args).

    Raises:
      SystemExit: bad flag values (argparse), or an unknown ``--flag``.
    """
    from dropless.cli import CONFIG_ARGS_HELP

    parser = argparse.ArgumentParser(
        prog="dropless profile", description=__doc__.splitlines()[0],
        usage="dropless profile [--dry-run] [options] [config.yml] [key=value ...]",
        epilog=f"{CONFIG_ARGS_HELP} --dry-run: check the config and data and print a per-device "
               "memory estimate; run nothing (its flags: dropless profile --dry-run --help).")
    parser.add_argument("--steps", type=int, default=3, help="steps to trace (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untraced steps first (default 2)")
    parser.add_argument("--top", type=int, default=15, help="kernels to list (default 15)")
    parser.add_argument("--python-trace", action="store_true",
                        help="also trace Python calls (large traces)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the results record goes (default benchmarks/results)")
    ns, rest = parser.parse_known_args(args)
    unknown = [a for a in rest if a.startswith("--")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if ns.steps < 1 or ns.warmup < 0 or ns.top < 1:
        parser.error(f"need --steps >= 1, --warmup >= 0, --top >= 1; got {ns.steps}, "
                     f"{ns.warmup}, {ns.top}")
    return ns, rest


def fp8_impls(model, train) -> dict | None:
    """How the grouped matmuls' FP8 recipe runs for this config on this process's devices
    (``nn.moe.fp8_impls`` at the buffer's rows): what ``gmm_fp8_impl=auto`` resolved to."""
    from dropless.nn import moe

    rows = int(train.per_device_batch_size) * train.max_target_length * model.moe.num_experts_per_tok
    return moe.fp8_impls(model.moe, model.emb_dim, rows, model.dtype)


def run_dir(cfg) -> Path:
    """``base_output_directory/run_name``; run_name defaults to '<model>-profile-<time>'."""
    name = cfg.run_name or f"{cfg.model_name}-profile-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return Path(cfg.base_output_directory) / name


class TrainerUnavailable(RuntimeError):
    """The trainer does not expose ``dropless.train.loop.build`` (yet)."""


def build_trainer(model_cfg, train_cfg, mesh_cfg):
    """(state, step_fn, batches, tflops_per_step or None) from ``dropless.train.loop.build``.

    ``tflops_per_step`` (analytic TFLOPs per device per step) is taken from the
    built trainer when it provides it.

    Raises:
      TrainerUnavailable: no such module or function.
      TypeError: ``build`` returned something without state/step_fn/batches.
    """
    import importlib

    try:
        loop = importlib.import_module("dropless.train.loop")
    except ModuleNotFoundError as e:
        if e.name != "dropless.train.loop":
            raise
        raise TrainerUnavailable("dropless.train.loop is not available in this version") from None
    build = getattr(loop, "build", None)
    if build is None:
        raise TrainerUnavailable("dropless.train.loop has no build(model_cfg, train_cfg, "
                                 "mesh_cfg) -> (state, step_fn, batches)")
    built = build(model_cfg, train_cfg, mesh_cfg)
    if type(built) is tuple and len(built) == 3:
        return (*built, None)
    try:
        return built.state, built.step_fn, built.batches, getattr(built, "tflops_per_step", None)
    except AttributeError:
        raise TypeError(f"dropless.train.loop.build returned {type(built).__name__}; expected "
                        "(state, step_fn, batches) or an object with those attributes") from None


def run_steps(state, step_fn, batches, steps: int, annotate: bool):
    """Run ``steps`` steps (each in a StepTraceAnnotation if ``annotate``); wait for the device."""
    import jax

    metrics = None
    for i in range(steps):
        if annotate:
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, metrics = step_fn(state, next(batches))
        else:
            state, metrics = step_fn(state, next(batches))
    jax.block_until_ready((state, metrics))
    return state, metrics


def capture(state, step_fn, batches, out: Path, *, steps: int, warmup: int, python_trace: bool):
    """Warm up, then trace ``steps`` steps into ``out``; returns (state, seconds traced)."""
    import jax

    state, _ = run_steps(state, step_fn, batches, warmup, annotate=False)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_trace else 0
    t0 = time.perf_counter()
    with jax.profiler.trace(str(out), create_perfetto_trace=True, profiler_options=options):
        state, _ = run_steps(state, step_fn, batches, steps, annotate=True)
    return state, time.perf_counter() - t0


def throughput(cfg, step_ms: float, per_step: float | None = None) -> dict:
    """Model TFLOPS/device and MFU at ``step_ms`` per step, from ``dropless.train.flops``.

    ``per_step``: TFLOPs per device per step if the trainer reported it;
    otherwise computed from the config with ``train.flops``.
    """
    import jax

    try:
        from dropless.train import flops
    except ImportError:
        return {}
    model_cfg, train_cfg = cfg.model(), cfg.train()
    if per_step is None:
        per_step = flops.training_tflops_per_device(
            model_cfg, train_cfg.per_device_batch_size, train_cfg.max_target_length,
            train_cfg.gradient_accumulation_steps).total
    achieved = per_step / (step_ms / 1e3) if step_ms > 0 else 0.0
    device = jax.devices()[0]
    peak = None if device.platform == "cpu" else flops.peak_tflops(
        device.device_kind, flops.precision_of(model_cfg))
    return {"tflops_per_device_per_step": per_step, "tflops_per_device": achieved,
            "mfu_pct": 100 * achieved / peak if peak else None}


def precision(config: dict) -> str:
    """The record's precision: fp8 when any matmul is quantized (dense
    ``quantization`` or the experts' ``te_gmm_quantization``), else bf16."""
    dense = config.get("quantization") or ""
    experts = config.get("te_gmm_quantization") or "te_no_quant"
    return "fp8" if dense or experts != "te_no_quant" else "bf16"


def profile_record(bd, cfg_facts: dict, extra: dict) -> dict:
    """The ``kind: profile`` results record of a breakdown (provenance from ``perf.measure``).

    Rows, one per category in ``breakdown.CATEGORIES`` order: category, label,
    ms_per_step (kernel time per step per device), pct_kernel, pct_wall, count.
    """
    from dropless.perf import measure

    steps, ndev = max(bd.steps, 1), max(len(bd.devices), 1)
    record = measure.new_record("profile", {**cfg_facts, "precision": precision(cfg_facts)})
    record["rows"] = [{"category": c["category"], "label": c["label"],
                       "ms_per_step": c["time_us"] / steps / ndev / 1e3,
                       "pct_kernel": c["pct_kernel"], "pct_wall": c["pct_wall"],
                       "count": c["count"]} for c in bd.categories]
    record.update({"steps": bd.steps, "devices_traced": bd.devices, "platform": bd.platform,
                   "step_ms": bd.wall_us / steps / 1e3,
                   "kernel_ms_per_step": bd.kernel_us / steps / ndev / 1e3,
                   "busy_pct": bd.busy_pct, "top_kernels": bd.top_kernels,
                   "top_by_category": bd.top_by_category, "notes": bd.notes})
    record.update({k: extra.get(k) for k in ("tflops_per_device", "tflops_per_device_per_step",
                                             "mfu_pct", "mesh", "changed", "xla_flags", "warmup")})
    return record


def main(args: list[str]) -> int:
    """Entry point of ``dropless profile``; returns the exit code.

    Raises:
      dropless.config.loader.ConfigError: a bad config (the CLI prints it).
    """
    if "--dry-run" in args:  # the config, data and memory estimate only (perf.dry_run)
        from dropless.perf import dry_run

        return dry_run.main([a for a in args if a != "--dry-run"], "profile")
    ns, rest = parse_args(args)
    from dropless.cli import resolve_args, start_runtime

    resolved = resolve_args(rest)
    cfg = resolved.config
    from dropless.perf import measure

    results_dir = Path(ns.out or measure.DEFAULT_RESULTS_DIR)
    try:  # before minutes of compiling: the record must have somewhere to go
        results_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(results_dir, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        print(f"dropless profile: --out {results_dir}: cannot write there ({e})", file=sys.stderr)
        return 2
    out = run_dir(cfg) / "profile"
    # Before JAX starts: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={out / 'hlo'}", "--xla_dump_hlo_as_text"]))
    applied, mesh_shape = start_runtime(cfg)
    from rich.console import Console

    from dropless.perf import breakdown, hlo, trace

    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        state, step_fn, batches, per_step = build_trainer(cfg.model(), cfg.train(), cfg.mesh())
    except TrainerUnavailable as e:
        print(f"dropless profile: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"profiling {ns.steps} steps after {ns.warmup} warm-up steps -> {out}")
    from dropless.train import user_errors

    with user_errors.memory_errors(cfg.model(), cfg.train()):  # one line naming the keys
        capture(state, step_fn, batches, out, steps=ns.steps, warmup=ns.warmup,
                python_trace=ns.python_trace)
    path = trace.find_trace_file(out)
    bd = breakdown.compute(trace.load_trace(path), top=ns.top,
                           hlo_ops=hlo.kernel_ops(out / "hlo", breakdown.F8_RESULT_TAG))
    step_ms = bd.wall_us / max(bd.steps, 1) / 1e3
    extra = {"model_name": cfg.model_name, "config": cfg.model_dump(mode="json"),
             "changed": {k: resolved.source(k) for k in resolved.sources}, "mesh": mesh_shape,
             "xla_flags": applied, "step_ms": step_ms,
             "device": measure.device_info(), "versions": measure.versions(),
             "commit": measure.git_commit(), **throughput(cfg, step_ms, per_step)}
    breakdown.save(bd, out / "breakdown.json", extra=extra)
    breakdown.plot(bd, out / "breakdown.png", title=f"{cfg.model_name}: where the time goes")
    facts = {k: getattr(cfg, k) for k in RECORD_KEYS}
    facts["gmm_fp8_impl_resolved"] = fp8_impls(cfg.model(), cfg.train())
    record = profile_record(bd, facts, {**extra, "warmup": ns.warmup})
    record_path = measure.write_record(record, results_dir)
    breakdown.print_breakdown(bd, console)
    if extra.get("tflops_per_device") is not None:
        mfu = extra.get("mfu_pct")
        console.print(f"{step_ms:.2f} ms/step, {extra['tflops_per_device']:.4g} TFLOPS/device"
                      + (f", MFU {mfu:.1f}%" if mfu is not None else ""))
    console.print(f"wrote {record_path}, {out / 'breakdown.json'}, {out / 'breakdown.png'}; "
                  f"trace {path} "
                  f"(Perfetto: {path.parent / 'perfetto_trace.json.gz'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
