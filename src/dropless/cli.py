"""Command line: ``dropless train | config | bench | profile | forward | export-hf | tokenize``.

``python -m dropless train [config.yml] key=value ...`` resolves the config
(base.yml < models/<model_name>.yml < config.yml < key=value < DROPLESS_<KEY>),
applies XLA flags and environment variables before JAX starts, then trains.
A problem the user can fix (config, data, tokenizer, hardware, memory, the
run directory, a checkpoint, a checkpoint disk too small for one save)
prints one line and exits with code 2; a run that fails partway (a checkpoint
save failing, an expert-parallel overflow under the ``error`` policy) prints
one line and exits 1. ``--debug`` anywhere on the command line shows the
traceback instead (and Orbax's logged errors keep theirs). Ctrl-C during
train's steps exits 130 and SIGTERM (a scheduler's preemption: the step in
progress is finished and saved, ``train.preemption``) exits 143, each with one
line naming the checkpoint to resume from.
"""

import argparse
import logging
import math
import os
import sys

EXIT_CONFIG = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_PREEMPTED = 143  # 128 + SIGTERM (train.preemption.EXIT_CODE): a scheduler's preemption


class _NoLibraryTracebacks(logging.Filter):
    """Drop the traceback of Orbax's logged errors (its writer threads log one per failed file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            record.exc_info, record.exc_text = None, None
        return True


_QUIET_ORBAX = _NoLibraryTracebacks()


CONFIG_ARGS_HELP = ("config.yml, key=value: the config, as for dropless train (every key, its default and "
                    "what it does: dropless config --keys). --debug: show the traceback of an error "
                    "instead of one line.")


def _command_parser(command: str) -> argparse.ArgumentParser:
    """``dropless train|config --help``: what the command takes (the parsing is ``_options``)."""
    about = {"train": "Train a model; resumes <base_output_directory>/<run_name> if it holds checkpoints.",
             "config": "Print the resolved config and where each value comes from."}
    p = argparse.ArgumentParser(
        prog=f"dropless {command}", description=about[command],
        epilog="Precedence, lowest first: base.yml < models/<model_name>.yml < config.yml < key=value "
               "< DROPLESS_<KEY> environment variables. Every key, its default and what it does: "
               "dropless config --keys. Bad input prints one line and exits 2.")
    p.add_argument("config", nargs="?", metavar="config.yml", help="a YAML file of key: value (optional)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config keys over the file's, e.g. steps=10")
    if command == "train":
        p.add_argument("--dry-run", action="store_true",
                       help="check the config and data and print a per-device memory estimate; train "
                            "nothing (its own flags: dropless train --dry-run --help)")
    else:
        p.add_argument("--changed", action="store_true", help="only the values that differ from the defaults")
        p.add_argument("--keys", action="store_true", help="every key with its default and description")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    return p


def _options(command: str, args: list[str], allowed: tuple[str, ...]) -> bool:
    """True when ``args`` ask for help (printed here). A ``-`` argument other than
    ``allowed`` is an error, not a config file name.

    Raises:
      ConfigError: an unknown option (one line).
    """
    if "-h" in args or "--help" in args:
        _command_parser(command).print_help()
        return True
    from dropless.config.loader import ConfigError

    for a in args:
        if a.startswith("-") and a not in allowed:
            raise ConfigError(f"unknown option {a} for dropless {command} (takes {', '.join(allowed)} and "
                              f"--debug; see dropless {command} --help)")
    return False


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The optional leading config path, then key=value overrides."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def resolve_args(args: list[str]):
    from dropless.config.loader import load_config

    config_file, overrides = _split_args(args)
    return load_config(config_file, overrides)


def start_runtime(cfg):
    """Apply env vars and (on GPU) XLA flags, join the multi-process job if any, then start JAX.

    ``hardware=gpu_multiprocess`` with no cluster found (``distributed.find_cluster``)
    is a job of one process: it runs, and one line says so. Returns the mesh shape.
    """
    from dropless.config.xla_flags import apply_runtime_settings, targets_gpu

    on_gpu = targets_gpu(cfg.hardware)
    if cfg.hardware == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    applied = apply_runtime_settings(cfg.xla_flags, cfg.env, on_gpu=on_gpu)
    from dropless.config.loader import ConfigError
    from dropless.parallel import distributed

    if not on_gpu:
        distributed.set_cpu_devices(_cpu_devices(cfg))
    try:  # found: a Detection when a multi-process job was asked for (the hardware or our variables)
        found = distributed.find_cluster(asked=cfg.hardware == "gpu_multiprocess")
        if found is not None and found.cluster is not None:
            distributed.join(found, cpu=not on_gpu)
    except (ValueError, distributed.ClusterError) as e:
        asked = "hardware=gpu_multiprocess: " if cfg.hardware == "gpu_multiprocess" else ""
        raise ConfigError(f"{asked}{e}") from e
    import jax

    from dropless.train.user_errors import check_hardware

    check_hardware(cfg.hardware)
    if cfg.jax_cache_dir:
        try:
            path = use_compilation_cache(cfg.jax_cache_dir)
        except ConfigError as e:
            if cfg.jax_cache_dir != type(cfg).model_fields["jax_cache_dir"].default:
                raise
            # The default, not asked for: a home without room for it runs uncached, said once.
            print(f"compilation cache: off: {e}", flush=True)
        else:
            print(f"compilation cache: {path} (jax_cache_dir; '' for none)", flush=True)
    if found is not None and found.cluster is None:  # a job of one process: said, not silent
        print(distributed.single_process_note(found, cfg.hardware, jax.local_device_count(),
                                              jax.default_backend()), flush=True)

    from dropless.config.schema import ContradictionError, resolve_mesh_shape

    try:
        # Each process is one DCN slice; ICI axes cover its local devices.
        shape = resolve_mesh_shape(cfg, jax.device_count(), jax.process_count())
    except ContradictionError as e:
        raise ConfigError(f"{e.key}={e.value!r}: {e}") from None
    return applied, shape


def use_compilation_cache(directory: str) -> str:
    """Point JAX's persistent compilation cache at ``directory`` (``jax_cache_dir``; ~
    expands), created if missing. Returns the path.

    Raises:
      ConfigError: the directory cannot be created or written (one line).
    """
    import jax

    from dropless.config.loader import ConfigError

    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise ConfigError(f"jax_cache_dir={directory!r}: cannot use {path} as the compilation "
                          f"cache ({e.strerror or e}); give a writable directory, or '' for none") from None
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def _cpu_devices(cfg) -> int:
    """``num_cpu_devices``, or (-1) the product of the fixed ICI mesh axes."""
    if cfg.num_cpu_devices > 0:
        return cfg.num_cpu_devices
    ways = [getattr(cfg, f"ici_{a}_parallelism") for a in ("data", "fsdp", "expert", "tensor")]
    return max(1, math.prod(w for w in ways if w > 0))


def cmd_train(args: list[str]) -> int:
    if "--dry-run" in args:  # check the config and estimate memory; train nothing
        from dropless.perf import dry_run

        return dry_run.main([a for a in args if a != "--dry-run"], "train")
    if _options("train", args, ("--dry-run",)):
        return 0
    resolved = resolve_args(args)
    cfg = resolved.config
    applied, _ = start_runtime(cfg)  # also checks the mesh against the devices
    from dropless.parallel.overflow import EPOverflowError
    from dropless.train.loop import run_training

    if applied:
        print(f"XLA flags: {' '.join(applied)}")
    try:
        result = run_training(cfg.model(), cfg.train(), cfg.mesh())
    except EPOverflowError as e:
        print(f"dropless: {e}", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


def cmd_config(args: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from dropless.config.schema import Config

    flags = ("--changed", "--keys")
    if _options("config", args, flags):
        return 0
    keys_only = "--keys" in args
    changed_only = "--changed" in args
    args = [a for a in args if a not in flags]
    console = Console()
    if keys_only:
        table = Table("key", "default", "description", title="dropless config keys")
        for name, field in Config.model_fields.items():
            table.add_row(name, repr(field.default), field.description or "")
        console.print(table)
        return 0
    resolved = resolve_args(args)
    cfg = resolved.config
    table = Table("key", "value", "from", title=f"resolved config ({cfg.model_name})")
    for name in Config.model_fields:
        if name in ("xla_flags", "env"):
            continue
        src = resolved.source(name)
        if changed_only and src == "default":
            continue
        table.add_row(name, repr(getattr(cfg, name)), src)
    for name, value in cfg.xla_flags.items():
        table.add_row(name, repr(value), f"{resolved.source(name)} (XLA flag, GPU only)")
    for name, value in cfg.env.items():
        table.add_row(name, repr(value), f"{resolved.source(name)} (environment)")
    console.print(table)
    return 0


def _delegate(module: str, args: list[str]) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            print(f"dropless: '{module}' is not available in this version", file=sys.stderr)
            return 1
        raise
    return mod.main(args) or 0


COMMANDS = {
    "train": (cmd_train, "train a model: dropless train [--dry-run] [config.yml] key=value ..."),
    "config": (cmd_config, "print the resolved config and each value's source (--changed, --keys)"),
    "bench": (lambda a: _delegate("dropless.perf.bench", a), "run the benchmark matrix on this machine's GPU"),
    "profile": (lambda a: _delegate("dropless.perf.profile", a), "capture a profiler trace and break down kernel time"),
    "forward": (lambda a: _delegate("dropless.train.forward", a),
                "logits of a checkpoint or Hugging Face model: forward [config.yml] key=value ... "
                "--tokens T.npy --out L.npy"),
    "export-hf": (lambda a: _delegate("dropless.train.export_hf", a),
                  "write a checkpoint as a Hugging Face directory: export-hf CKPT --out DIR"),
    "tokenize": (lambda a: _delegate("dropless.train.tokenize", a),
                 "text files -> one .npy token file (dataset_path for multi-host training)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    width = max(map(len, COMMANDS))
    parser = argparse.ArgumentParser(
        prog="dropless", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Dropless Mixture-of-Experts training in JAX.",
        epilog="commands:\n" + "\n".join(f"  {k:<{width}}  {v[1]}" for k, v in COMMANDS.items())
               + "\n\ndropless <command> --help: what a command takes. --debug anywhere: a traceback "
                 "instead of one line on error.")
    parser.add_argument("command", choices=COMMANDS, metavar="command", help="one of the commands below")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="...",
                        help="the command's own arguments")
    debug = "--debug" in argv
    ns = parser.parse_args([a for a in argv if a != "--debug"])
    from dropless.config.loader import ConfigError

    from absl import logging as absl_logging  # before any getLogger("absl"): it makes absl's own logger

    absl_logger = absl_logging.get_absl_logger()  # where Orbax's records go
    if debug:
        absl_logger.removeFilter(_QUIET_ORBAX)
    else:
        absl_logger.addFilter(_QUIET_ORBAX)

    try:
        return COMMANDS[ns.command][0](ns.args)
    except KeyboardInterrupt:  # Ctrl-C outside train's steps (those say more: cmd_train)
        if debug:
            raise
        print("dropless: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as e:
        if debug:
            raise
        print(f"dropless: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:
        # TrainingInterrupted (Ctrl-C in train's steps) and TrainingPreempted (SIGTERM
        # there; one line even with --debug: a preemption is no error) say where the run
        # stopped and what resumes it. CheckpointError says which checkpoint is bad and
        # how to fall back. Their modules are loaded only if training started (they import JAX).
        loop = sys.modules.get("dropless.train.loop")
        if not debug and loop is not None and isinstance(e, loop.TrainingInterrupted):
            print(f"dropless: {_one_line(e)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if loop is not None and isinstance(e, loop.TrainingPreempted):
            print(f"dropless: {_one_line(e)}", file=sys.stderr)
            return EXIT_PREEMPTED
        ckpt = sys.modules.get("dropless.train.checkpoint")
        if debug or ckpt is None or not isinstance(e, (ckpt.CheckpointError, ckpt.CheckpointSaveError)):
            raise
        if isinstance(e, ckpt.CheckpointSaveError):  # the run failed partway; earlier saves are intact
            print(f"dropless: error: {_one_line(e)}", file=sys.stderr)
            return EXIT_RUN_FAILED
        print(f"dropless: checkpoint error: {_one_line(e)}", file=sys.stderr)
        return EXIT_CONFIG


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
