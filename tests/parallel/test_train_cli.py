"""``python -m dropless train`` expert-parallel on CPU: 8 devices in one process, and
two processes joined by ``jax.distributed`` (gloo) with the expert axis across them.

Each run is a fresh process (JAX fixes its device count at start-up); the
model is deepseek3-tiny cut down so that compiling dominates less. XLA:CPU
compiles at optimisation level 0.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["num_decoder_layers=2", "emb_dim=32", "per_device_batch_size=2", "max_target_length=16",
         "remat_policy=none", "enable_tensorboard=false", "enable_checkpointing=false"]


def _env(**extra):
    """This environment without multi-process variables, CPU only, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0",
            **extra}


def _rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_trained(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["applied"] and r["overflow_tokens"] == 0 for r in rows)
    assert all(r["ep_rows_sent"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_train_on_eight_cpu_devices(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dropless", "train", "ici_expert_parallelism=8", "steps=4",
         f"base_output_directory={tmp_path}", "run_name=ep8", *SMALL],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "'expert': 8" in proc.stdout
    _check_trained(_rows(tmp_path / "ep8"), 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_with_jax_distributed(tmp_path):
    address = f"localhost:{_free_port()}"
    args = [sys.executable, "-m", "dropless", "train", "hardware=cpu", "ici_expert_parallelism=2",
            "dcn_expert_parallelism=2", "steps=3", f"base_output_directory={tmp_path}",
            "run_name=mp", *SMALL]
    procs = [
        subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2",
                                  JAX_PROCESS_ID=str(i)))
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    # Two processes of two CPU devices each; the expert axis spans both.
    assert "'expert': 4" in outs[0]
    _check_trained(_rows(tmp_path / "mp"), 3)
