"""Apply the config's XLA flags and environment variables before JAX starts.

XLA reads ``XLA_FLAGS`` once, when the backend initialises, and aborts the
whole process on a flag it does not know. So flags are checked against the
flag names compiled into the installed jaxlib (and its CUDA plugin) first, and
an unknown one becomes a clear ``ConfigError`` instead of an abort. Flags are
applied only when the job will run on a GPU; environment variables always.
"""

import functools
import importlib.util
import mmap
import os
import re
from pathlib import Path

from dropless.config.loader import ConfigError

_FLAG_NAME = re.compile(rb"xla_[a-z0-9_]{3,}")


def _library_dirs() -> list[Path]:
    dirs = []
    for mod in ("jaxlib", "jax_plugins"):
        spec = importlib.util.find_spec(mod)
        if spec and spec.submodule_search_locations:
            dirs.extend(Path(p) for p in spec.submodule_search_locations)
    return dirs


@functools.lru_cache(maxsize=1)
def known_xla_flags() -> frozenset[str]:
    """Flag names present in the installed jaxlib's shared libraries."""
    names = set()
    for d in _library_dirs():
        for lib in d.rglob("*.so*"):
            try:
                with open(lib, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    names.update(m.decode() for m in _FLAG_NAME.findall(mm))
            except (OSError, ValueError):
                continue
    return frozenset(names)


def format_flag(name: str, value) -> str:
    """``--name=value``; booleans lower-case, shell-style quotes stripped."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    value = str(value).strip().strip("'\"")
    return f"--{name}={value}"


def check_xla_flags(flags: dict) -> None:
    """Raise ConfigError for a flag the installed jaxlib does not define."""
    if not flags:
        return
    known = known_xla_flags()
    if not known:  # cannot inspect this jaxlib: let XLA decide
        return
    import difflib

    for name, value in flags.items():
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{name}={value!r}: not an XLA flag of the installed jaxlib{hint}")


def gpu_present() -> bool:
    """A CUDA GPU will be used: plugin installed, device node present, not forced off."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    has_plugin = any(
        _module_exists(m)
        for m in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
    )
    return has_plugin and Path("/dev/nvidiactl").exists()


GPU_HARDWARE = ("gpu", "gpu_multiprocess")  # the ``hardware`` values that ask for GPUs


def targets_gpu(hardware: str) -> bool:
    """The job runs on GPUs: ``hardware`` asks for them, or (``auto``) one is present."""
    return hardware in GPU_HARDWARE or (hardware == "auto" and gpu_present())


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # parent package missing
        return False


# Flags dropless sets on a GPU unless the config or the XLA_FLAGS environment variable names
# them. The latency-hiding scheduler is off by default in XLA:GPU (jaxlib 0.11.2), and without
# it XLA leaves most collectives synchronous: compiled for one host of 8 H200s, the DeepSeek
# proxy with ici_expert_parallelism=8 runs 2 of its 24 ragged all-to-alls (the experts' token
# exchange) asynchronously, and 38 of 66 all-gathers; with it, 24 of 24 and 61 of 66, each with
# compute scheduled beside it. The proxy's step on one H200 compiles to the same program
# either way (`benchmarks/notes/gpu_plan.md`, "overlapped collectives").
GPU_DEFAULTS = {"xla_gpu_enable_latency_hiding_scheduler": True}


def _named_in(flag: str, xla_flags: str) -> bool:
    return re.search(rf"--{re.escape(flag)}(?:=|\s|$)", xla_flags) is not None


def apply_runtime_settings(flags: dict, env: dict, *, on_gpu: bool) -> list[str]:
    """Set env vars, then append the flags to XLA_FLAGS (GPU only), with ``GPU_DEFAULTS``
    first for each default that neither ``flags`` nor XLA_FLAGS (as ``env`` leaves it) names.

    Must run before the first JAX computation. Returns the flags applied.
    """
    check_xla_flags(flags)
    for name, value in env.items():
        os.environ[name] = str(value)
    if not on_gpu:
        return []
    known = known_xla_flags()
    given = os.environ.get("XLA_FLAGS", "")
    defaults = {n: v for n, v in GPU_DEFAULTS.items()
                if n not in flags and not _named_in(n, given) and (not known or n in known)}
    flags = {**defaults, **flags}
    if not flags:
        return []
    applied = [format_flag(n, v) for n, v in flags.items()]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), *applied]))
    return applied
