"""Multi-process start (``jax.distributed``) and the host-device count, before JAX starts.

One process per host (GPU) or per simulated host (CPU). Where the job's
coordinates come from, first match wins:

1. the environment variables ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of
   process 0), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (all three, as
   torchrun-style launchers set them);
2. otherwise JAX's own cluster detection (SLURM, Open MPI, Kubernetes ...),
   which needs no variables.

``find_cluster`` asks both *before* anything is started, using JAX's own
detectors (``jax._src.clusters.ClusterEnv`` subclasses and their
``is_env_present``, the code ``jax.distributed.initialize()`` runs), so a job
that finds no cluster is known to be one process without parsing an error
from ``initialize``. ``hardware=gpu_multiprocess`` on one host with no
launcher is such a job of size 1: the CLI runs it as one process and says so
(``single_process_note``). Where a cluster is found, ``join`` first checks
its coordinator (``check_coordinator``), because XLA aborts or crashes the
process on a taken port or an unreachable coordinator instead of raising.

On CPU the cross-process collectives go through gloo, and the number of
host devices per process is set here too (``set_cpu_devices``); both must
happen before the first JAX computation, which is why this module touches
only ``jax.config`` until ``initialize`` runs.
"""

import os
import socket
import time
import warnings
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


class ClusterError(RuntimeError):
    """A cluster was found but this process cannot join it (a one-line message)."""


# JAX's cluster types (jax/_src/clusters, jax 0.11.2) by the names their users know.
_CLUSTER_NAMES = {"OmpiCluster": "Open MPI", "SlurmCluster": "SLURM", "Mpi4pyCluster": "mpi4py",
                  "BaseTpuCluster": "Cloud TPU", "GkeTpuCluster": "Cloud TPU", "GceTpuCluster": "Cloud TPU",
                  "K8sCluster": "Kubernetes"}
OUR_VARIABLES = f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}"
JAX_DETECTION = "JAX's cluster detection"


class Detection(NamedTuple):
    """What ``find_cluster`` found and what it looked for."""

    cluster: str | None  # e.g. "SLURM", OUR_VARIABLES, JAX_DETECTION (not inspectable); None: no cluster
    checked: tuple[str, ...]  # JAX's detectors asked, in JAX's order
    notes: tuple[str, ...] = ()  # warnings JAX's detectors gave (first sentence each)
    detector: type | None = None  # JAX's ClusterEnv subclass that found it
    spec: ProcessSpec | None = None  # our variables' coordinates, when they found it


def _jax_cluster_types() -> list[type] | None:
    """The ClusterEnv subclasses ``jax.distributed.initialize()`` tries when asked
    nothing (opt-in ones such as mpi4py excluded), in its order; None if this
    jax has no such registry."""
    try:
        from jax._src import clusters

        types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        return None
    return [t for t in types if not getattr(t, "opt_in_only_method", False)]


def _first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".")


def find_cluster(asked: bool = True) -> Detection | None:
    """The multi-process job this process belongs to, as ``jax.distributed.initialize`` would find it.

    Reads ``os.environ`` (once per call: the result carries our variables'
    ``ProcessSpec`` to ``join``): first our three variables, then each of
    JAX's detectors. Starts nothing and reaches no coordinator (the Kubernetes
    detector reads its in-cluster config; the GCE TPU one asks the metadata
    server, only on a Cloud TPU VM). ``asked=False`` (a job that did not ask
    for several processes): only our variables naming more than one process
    make a job; otherwise None, and JAX's detectors are not asked.

    Raises:
      ValueError: only some of our three variables set, or bad values.
      ClusterError: a detector of JAX failed (e.g. Kubernetes without its
        service-account files).
    """
    spec = spec_from_env()
    if spec is not None and (asked or spec.num_processes > 1):
        return Detection(OUR_VARIABLES, (), spec=spec)
    if not asked:
        return None
    types = _jax_cluster_types()
    if types is None:  # cannot ask beforehand: initialize() decides, and its error is reported
        return Detection(JAX_DETECTION, ())
    names = [_CLUSTER_NAMES.get(t.__name__, t.__name__) for t in types]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t, name in zip(types, names):
            try:
                present = t.is_env_present()
            except Exception as e:  # noqa: BLE001 - jax's initialize() would fail the same way
                raise ClusterError(f"{name} detected, but JAX cannot read it: "
                                   f"{type(e).__name__}: {_first_sentence(str(e))}") from e
            if present:
                return Detection(name, (), detector=t)
    notes = tuple(dict.fromkeys(_first_sentence(str(w.message)) for w in caught))
    return Detection(None, tuple(dict.fromkeys(names)), notes)


def single_process_note(detection: Detection, hardware: str, num_devices: int, platform: str) -> str:
    """The line that says a job found no cluster and runs as one process on this host."""
    devices = f"{num_devices} {'GPU' if platform == 'gpu' else platform + ' device'}{'s' * (num_devices != 1)}"
    looked = f"no {OUR_VARIABLES}"
    if detection.checked:
        looked += f"; JAX detects none of {', '.join(detection.checked)}"
    notes = "".join(f"; JAX: {n}" for n in detection.notes)
    return (f"hardware={hardware}: no cluster found ({looked}{notes}): "
            f"running as one process on this host's {devices}")


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
    return _start(spec_from_env(env), cpu, timeout_s)


def _start(spec: ProcessSpec | None, cpu: bool, timeout_s: int) -> ProcessSpec | None:
    import jax

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


def coordinates(detection: Detection) -> ProcessSpec | None:
    """The job's coordinates where the environment alone gives them (our
    variables; SLURM, whose coordinator JAX derives from the step's first host
    and the job id); None for launchers JAX must ask (Kubernetes, MPI)."""
    if detection.cluster == OUR_VARIABLES:
        return detection.spec
    t = detection.detector
    if t is None or t.__name__ != "SlurmCluster":
        return None
    try:
        address = t.get_coordinator_address(timeout_secs=None,
                                            override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
        return ProcessSpec(address, t.get_process_count(), t.get_process_id())
    except Exception:  # noqa: BLE001 - unreadable here: initialize() reports it
        return None


def check_coordinator(spec: ProcessSpec, timeout_s: float) -> None:
    """Fail in one line where ``jax.distributed.initialize`` would kill the process.

    XLA's coordination client aborts the process (and its server crashes)
    instead of raising, so the two commonest mistakes are checked first:
    process 0 must be able to listen on the coordinator's port (nothing else
    on this host holds it), and every other process must reach the
    coordinator within ``timeout_s``. Processes that never arrive at a
    reachable coordinator still end in XLA's abort after its timeout.

    Raises:
      ClusterError: naming the address and what was wrong.
    """
    host, _, port = spec.coordinator_address.rpartition(":")
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    if spec.process_id == 0:
        port = bind.rpartition(":")[2] if bind else port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", int(port)))
            except OSError as e:
                raise ClusterError(f"process 0 cannot listen on port {port} of coordinator "
                                   f"{spec.coordinator_address}: {e.strerror} (another job on this host? "
                                   "set JAX_COORDINATOR_PORT or JAX_COORDINATOR_ADDRESS to a free port)") from None
        return
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)).close()
            return
        except socket.gaierror as e:
            raise ClusterError(f"coordinator {spec.coordinator_address}: host {host!r} does not resolve "
                               f"({e.strerror})") from None
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ClusterError(f"process {spec.process_id} of {spec.num_processes} cannot reach the "
                                   f"coordinator {spec.coordinator_address} within {timeout_s:g} s "
                                   f"({e.strerror or e}); is process 0 running, and is that address "
                                   "reachable from this host?") from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def join(detection: Detection, *, cpu: bool = False, timeout_s: int = 300) -> None:
    """``initialize`` for the cluster ``find_cluster`` found, after ``check_coordinator``.

    Raises:
      ClusterError: the coordinator cannot be used (``check_coordinator``), or
        ``jax.distributed.initialize`` failed (bad variables, JAX already
        started ...); the message names the cluster and what was wrong.
    """
    spec = coordinates(detection)
    if spec is not None:
        try:
            check_coordinator(spec, timeout_s)
        except ClusterError as e:
            raise ClusterError(f"{detection.cluster} found, but {e}") from None
    try:
        _start(detection.spec, cpu, timeout_s)
    except Exception as e:  # noqa: BLE001 - any failure to join is reported the same way
        where = (f"{detection.cluster} found, but" if detection.cluster != JAX_DETECTION
                 else "this jax's cluster detectors could not be asked beforehand, and")
        raise ClusterError(f"{where} jax.distributed.initialize failed: {type(e).__name__}: "
                           f"{' '.join(str(e).split())}") from e


def shutdown() -> None:
    """Leave the job (a no-op when ``jax.distributed`` was never started)."""
    import jax

    try:
        jax.distributed.shutdown()
    except RuntimeError:
        pass
