"""Finding the multi-process job before ``jax.distributed.initialize`` runs.

Each case fakes a launcher's environment variables (no real cluster) and
checks ``find_cluster`` against what JAX itself would do with them: JAX's
``ClusterEnv.auto_detect_unset_distributed_params`` (the code ``initialize``
runs) leaves the coordinator address unset exactly when no cluster is found,
which is the case where ``initialize`` fails with "coordinator_address should
be defined".
"""

import os
import socket
import time

import jax
import pytest
from jax._src import clusters
from jax._src.clusters.slurm_cluster import SlurmCluster

from dropless.parallel import distributed

# Variables of launchers JAX detects (and ours): none may leak in from the machine running the tests.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "KUBERNETES_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR",
                      "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
OPEN_MPI_4 = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
              "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
OURS = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}


@pytest.fixture
def bare_env(monkeypatch):
    """os.environ without any launcher's variables; returns a function that adds some."""
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)

    def add(variables):
        for k, v in variables.items():
            monkeypatch.setenv(k, v)
    return add


def _jax_coordinator():
    """The coordinator address JAX's own detection derives from os.environ (None: no cluster)."""
    address, *_ = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 5)
    return address


def test_one_host_without_a_launcher_is_no_cluster(bare_env):
    found = distributed.find_cluster()
    assert found.cluster is None and _jax_coordinator() is None
    assert {"Open MPI", "SLURM", "Kubernetes"} <= set(found.checked)


@pytest.mark.parametrize("variables,name", [
    (SLURM, "SLURM"),
    (OPEN_MPI_4, "Open MPI"),
    # Open MPI 5 (PRRTE) sets no ORTE URI; JAX knows it by OMPI_VERSION.
    ({**{k: v for k, v in OPEN_MPI_4.items() if k.startswith("OMPI_COMM")}, "OMPI_VERSION": "5.0.3"},
     "Open MPI"),
])
def test_a_launcher_jax_detects_is_found(bare_env, variables, name):
    bare_env(variables)
    assert distributed.find_cluster().cluster == name
    if name == "SLURM":  # JAX derives the same job: the first host of the step, a port from the job id
        assert _jax_coordinator() == _slurm_address()


def test_a_slurm_allocation_without_a_job_step_is_no_cluster(bare_env):
    """An ``salloc`` shell has a job id but no step: not a job of processes, for JAX either."""
    bare_env({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2"})
    assert distributed.find_cluster().cluster is None and _jax_coordinator() is None


def test_our_variables_come_first(bare_env):
    bare_env({**SLURM, **OURS})
    assert distributed.find_cluster().cluster == distributed.OUR_VARIABLES


def test_a_job_that_did_not_ask_needs_our_variables_naming_several_processes(bare_env):
    """``asked=False`` (hardware other than gpu_multiprocess): SLURM's variables, or ours
    naming one process, make no job; ours naming two do."""
    bare_env(SLURM)
    assert distributed.find_cluster(asked=False) is None
    bare_env({**OURS, "JAX_NUM_PROCESSES": "1"})
    assert distributed.find_cluster(asked=False) is None
    bare_env(OURS)
    assert distributed.find_cluster(asked=False).cluster == distributed.OUR_VARIABLES


def test_our_variables_are_read_once_on_the_way_to_initialize(bare_env, monkeypatch):
    """find_cluster parses them; join checks and starts from that parse."""
    calls, started = [], []
    parse = distributed.spec_from_env
    monkeypatch.setattr(distributed, "spec_from_env", lambda env=None: calls.append(env) or parse(env))
    monkeypatch.setattr(distributed, "check_coordinator", lambda spec, timeout_s: started.append(spec))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **k: started.append(k["coordinator_address"]))
    bare_env(OURS)
    distributed.join(distributed.find_cluster(asked=False))
    assert len(calls) == 1 and started == [("10.0.0.1:1234", 2, 0), "10.0.0.1:1234"]


def test_some_of_our_variables_is_an_error(bare_env):
    bare_env({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        distributed.find_cluster()


@pytest.mark.skipif(__import__("importlib").util.find_spec("kubernetes") is not None,
                    reason="checks a machine without the kubernetes package")
def test_kubernetes_without_its_package_is_said(bare_env):
    """JAX skips a pod it cannot bootstrap (and warns); the warning goes into our one line."""
    bare_env({"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    found = distributed.find_cluster()
    with pytest.warns(UserWarning, match=r"`kubernetes` package is not\s+installed"):
        assert found.cluster is None and _jax_coordinator() is None
    assert any("`kubernetes` package is not installed" in n for n in found.notes), found.notes
    line = distributed.single_process_note(found, "gpu_multiprocess", 8, "gpu")
    assert "\n" not in line and "`kubernetes` package is not installed" in line


def test_a_detector_that_fails_is_a_cluster_error(bare_env, monkeypatch):
    def broken(cls):
        raise OSError("service account token not found")
    monkeypatch.setattr(SlurmCluster, "is_env_present", classmethod(broken))
    with pytest.raises(distributed.ClusterError, match="SLURM detected, but JAX cannot read it: OSError"):
        distributed.find_cluster()


def test_the_single_process_line():
    found = distributed.Detection(None, ("Open MPI", "SLURM", "Kubernetes"))
    assert distributed.single_process_note(found, "gpu_multiprocess", 8, "gpu") == (
        "hardware=gpu_multiprocess: no cluster found (no JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/"
        "JAX_PROCESS_ID; JAX detects none of Open MPI, SLURM, Kubernetes): running as one process "
        "on this host's 8 GPUs")
    assert distributed.single_process_note(found, "gpu_multiprocess", 1, "gpu").endswith("this host's 1 GPU")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_slurm_coordinates_are_the_ones_jax_derives():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SLURM.items():
            mp.setenv(k, v)
        mp.delenv("JAX_COORDINATOR_PORT", raising=False)
        found = distributed.Detection("SLURM", (), detector=SlurmCluster)
        assert distributed.coordinates(found) == (_slurm_address(), 2, 1)
        mp.setenv("JAX_COORDINATOR_PORT", "12345")
        assert distributed.coordinates(found) == ("gpu001:12345", 2, 1)


def _slurm_address():
    return f"gpu001:{4242 % 2**12 + 65535 - 2**12 + 1}"


def test_process_0_whose_port_is_taken(monkeypatch):
    """XLA's coordination server crashes the process on a taken port; we say so first."""
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(distributed.ClusterError, match=f"process 0 cannot listen on port {port} "):
            distributed.check_coordinator(distributed.ProcessSpec(f"localhost:{port}", 2, 0), 1)
    distributed.check_coordinator(distributed.ProcessSpec(f"localhost:{port}", 2, 0), 1)  # free again


def test_another_process_needs_a_reachable_coordinator():
    port = _free_port()
    spec = distributed.ProcessSpec(f"localhost:{port}", 2, 1)
    start = time.monotonic()
    with pytest.raises(distributed.ClusterError, match=f"process 1 of 2 cannot reach the coordinator "
                                                       f"localhost:{port} within 0.5 s"):
        distributed.check_coordinator(spec, 0.5)
    assert time.monotonic() - start < 5
    with pytest.raises(distributed.ClusterError, match="host 'no-such-host.invalid' does not resolve"):
        distributed.check_coordinator(distributed.ProcessSpec("no-such-host.invalid:1234", 2, 1), 30)
    with socket.socket() as coordinator:
        coordinator.bind(("localhost", port))
        coordinator.listen()
        distributed.check_coordinator(spec, 0.5)


def test_a_slurm_coordinator_that_cannot_be_reached_is_named(bare_env, monkeypatch):
    """Process 1 of a SLURM step whose first host does not exist: one error, and JAX's
    initialize (which would abort the process) is never called."""
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: pytest.fail("initialize called"))
    bare_env({**SLURM, "SLURM_STEP_NODELIST": "no-such-host.invalid"})
    with pytest.raises(distributed.ClusterError, match="^SLURM found, but coordinator no-such-host.invalid:"):
        distributed.join(distributed.find_cluster())


def test_a_cluster_that_cannot_be_joined_is_named(bare_env):
    """A real ``initialize`` failure: JAX refuses once its backend has started (as it has here)."""
    jax.devices()
    bare_env({**SLURM, "SLURM_STEP_NODELIST": "localhost", "SLURM_PROCID": "0",
              "JAX_COORDINATOR_PORT": str(_free_port())})
    found = distributed.find_cluster()
    with pytest.raises(distributed.ClusterError,
                       match=r"^SLURM found, but jax.distributed.initialize failed: RuntimeError: .*before"):
        distributed.join(found)
