"""The run directory: made writable up front, its config written once, resumes checked.

``<base_output_directory>/<run_name>/config.json`` records the config a run
started with (the model, train and mesh sections) and is never overwritten. A
later start in the same directory (a resume) must bring the same config: a
changed ``steps`` reshapes the learning-rate schedule, a changed batch the
data order. It is refused with one line naming the differing keys, unless
``allow_config_change_on_resume`` is set; then the differences are printed and
appended to ``config_changes.jsonl``, and the next resume compares against
``config.json`` with those changes applied.

Keys that do not change what is computed (logging, checkpoint cadence, where
the directory lives) may change freely: ``FREE_KEYS``.
"""

import dataclasses
import json
import os
import tempfile
import time

from flax.traverse_util import flatten_dict

from dropless.config.loader import ConfigError

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Section fields a resume may change without asking: they change how the run is
# logged, saved or watched, not the numbers it computes.
FREE_KEYS = frozenset({
    "log_period", "enable_tensorboard", "enable_checkpointing", "checkpoint_period",
    "async_checkpointing", "max_num_checkpoints_to_keep", "checkpoint_warm_host_memory",
    "checkpoint_pinned_host_transfer", "checkpoint_device_snapshot",
    "base_output_directory", "jax_cache_dir",
    "load_parameters_path", "hf_model_path", "allow_config_change_on_resume", "hardware",
    "ep_overflow_check_every_n_steps", "ep_overflow_policy",
})


def make_run_dir(base_output_directory: str, run_name: str) -> str:
    """Create ``base_output_directory/run_name`` and check it is writable; returns its absolute path.

    Raises:
      ConfigError: the directory cannot be created or written (one line).
    """
    run_dir = os.path.abspath(os.path.join(base_output_directory, run_name))
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"base_output_directory={base_output_directory!r}: cannot write the run "
                          f"directory {run_dir} ({reason}); choose a writable base_output_directory") from None
    return run_dir


def sections_dict(model, train, mesh) -> dict:
    """The config as ``config.json`` records it: {"model", "train", "mesh"} nested dicts."""
    as_json = lambda x: json.loads(json.dumps(dataclasses.asdict(x)))  # tuples -> lists
    return {"model": as_json(model), "train": as_json(train), "mesh": as_json(mesh)}


def _apply(flat: dict, changes: dict) -> dict:
    return {**flat, **{k: new for k, (_, new) in changes.items()}}


def recorded_config(run_dir: str) -> dict | None:
    """The flat config the run in ``run_dir`` has now: config.json plus its logged changes (None: new run)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        flat = flatten_dict(json.load(f), sep=".")
    changes_path = os.path.join(run_dir, CHANGES_FILE)
    if os.path.exists(changes_path):
        with open(changes_path) as f:
            for line in f:
                if line.strip():
                    flat = _apply(flat, json.loads(line)["changes"])
    return flat


def differences(old: dict, new: dict) -> dict:
    """{dotted key: [old, new]} of the keys that differ, FREE_KEYS left out."""
    keys = sorted(set(old) | set(new))
    return {k: [old.get(k), new.get(k)] for k in keys
            if old.get(k) != new.get(k) and k.rsplit(".", 1)[-1] not in FREE_KEYS}


def _describe(diffs: dict) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]} {old!r} -> {new!r}" for k, (old, new) in diffs.items())


def record_config(run_dir: str, config: dict, *, allow_change: bool, primary: bool,
                  say=print) -> dict:
    """Write ``config.json`` for a new run, or check a resumed run's config against it.

    Args:
      config: ``sections_dict(model, train, mesh)``.
      allow_change: ``allow_config_change_on_resume``.
      primary: whether this process writes files (process 0).
      say: prints the differences when they are allowed.

    Returns:
      The differences accepted ({} for a new run or an unchanged one).

    Raises:
      ConfigError: the config differs and ``allow_change`` is false (one line).
    """
    old = recorded_config(run_dir)
    if old is None:
        if primary:
            tmp = os.path.join(run_dir, CONFIG_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(config, f, indent=1)
            os.replace(tmp, os.path.join(run_dir, CONFIG_FILE))
        return {}
    diffs = differences(old, flatten_dict(config, sep="."))
    if not diffs:
        return {}
    if not allow_change:
        raise ConfigError(
            f"run directory {run_dir} holds a run with another config ({_describe(diffs)}); "
            "use a new run_name, or allow_config_change_on_resume=true to continue it with these changes")
    say(f"resuming with a changed config: {_describe(diffs)} (logged to {CHANGES_FILE})")
    if primary:
        with open(os.path.join(run_dir, CHANGES_FILE), "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changes": diffs}) + "\n")
    return diffs
