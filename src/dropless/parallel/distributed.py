"""Multi-process start (``jax.distributed``) and the host-device count, before JAX starts.

One process per host (GPU) or per simulated host (CPU). Where the job's
coordinates come from, first match wins:

1. the environment variables ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of
   process 0), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (all three, as
   torchrun-style launchers set them);
2. otherwise JAX's own cluster detection (SLURM, Open MPI, Kubernetes ...),
   which needs no variables.

On CPU the cross-process collectives go through gloo, and the number of
host devices per process is set here too (``set_cpu_devices``); both must
happen before the first JAX computation, which is why this module touches
only ``jax.config`` until ``initialize`` runs.
"""

import os
from typing import Mapping, NamedTuple

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class ProcessSpec(NamedTuple):
    """Explicit coordinates of this process in a multi-process job."""

    coordinator_address: str
    num_processes: int
    process_id: int


def spec_from_env(env: Mapping[str, str] | None = None) -> ProcessSpec | None:
    """The job's coordinates from ``env`` (default ``os.environ``), or None if not all set.

    Raises:
      ValueError: only some of the three variables set, or values out of range.
    """
    env = os.environ if env is None else env
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [n for n in names if env.get(n, "").strip()]
    if not present:
        return None
    if len(present) != len(names):
        missing = [n for n in names if n not in present]
        raise ValueError(f"multi-process start: {present} set but {missing} missing; set all "
                         f"three or none (then JAX detects SLURM/MPI/Kubernetes)")
    try:
        count, pid = int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID])
    except ValueError:
        raise ValueError(f"{ENV_NUM_PROCESSES}={env[ENV_NUM_PROCESSES]!r} and "
                         f"{ENV_PROCESS_ID}={env[ENV_PROCESS_ID]!r} must be integers") from None
    if count < 1 or not 0 <= pid < count:
        raise ValueError(f"{ENV_PROCESS_ID}={pid} must be in [0, {ENV_NUM_PROCESSES}={count})")
    address = env[ENV_COORDINATOR].strip()
    if ":" not in address:
        raise ValueError(f"{ENV_COORDINATOR}={address!r} must be host:port")
    return ProcessSpec(address, count, pid)


def wants_multiprocess(env: Mapping[str, str] | None = None) -> bool:
    """True when the environment describes a job of more than one process."""
    spec = spec_from_env(env)
    return spec is not None and spec.num_processes > 1


def set_cpu_devices(count: int) -> None:
    """Give this process ``count`` CPU devices (before JAX starts its backends).

    Raises:
      ValueError: count < 1.
      RuntimeError: JAX already started with a different number of CPU devices.
    """
    if count < 1:
        raise ValueError(f"num_cpu_devices={count} must be >= 1")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        # Started already (e.g. a second run in one process): fine if it has the count.
        have = len(jax.local_devices(backend="cpu"))
        if have != count:
            raise RuntimeError(f"JAX already started with {have} CPU devices; {count} were "
                               "asked for (set the count before the first JAX computation)") from None


def initialize(env: Mapping[str, str] | None = None, *, cpu: bool = False,
               timeout_s: int = 300) -> ProcessSpec | None:
    """Start ``jax.distributed`` from the environment (see the module docstring).

    Args:
      env: variables to read (default ``os.environ``).
      cpu: the job runs on CPU devices: use gloo for cross-process collectives.
      timeout_s: how long to wait for the other processes.

    Returns:
      The explicit ``ProcessSpec`` used, or None when JAX detected the cluster.

    Raises:
      ValueError: inconsistent variables. RuntimeError / jax errors: the
        coordinator cannot be reached in time.
    """
    import jax

    spec = spec_from_env(env)
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec is None:
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return None
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
        process_id=spec.process_id, initialization_timeout=timeout_s,
    )
    return spec


def shutdown() -> None:
    """Leave the job (a no-op when ``jax.distributed`` was never started)."""
    import jax

    try:
        jax.distributed.shutdown()
    except RuntimeError:
        pass
