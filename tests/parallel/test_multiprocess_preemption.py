"""SIGTERM to one process of a two-process ``dropless train`` on CPU: JAX's
preemption service (``train.preemption``) makes both processes stop after the
same step, save it together and exit 143 with the same line.

What the single-process tests (``tests/train/test_preemption.py``) cannot
show: the agreement itself, through JAX's C++ SIGTERM handler, its
coordination service and Orbax's multi-process save. Two processes on CPU take
about 40 s on two cores (mostly start-up and the compile), more than the
fast tests' budget: set ``DROPLESS_SLOW=1`` to run it.
"""

import json
import subprocess
import sys
import time

import pytest

from dropless.train import checkpoint as ckpt_lib
from test_multiprocess_train import REPO, _env, _free_port, _manifest_covers_every_file

pytestmark = pytest.mark.slow(reason="two processes, ~40 s")

# Enough steps that the run is still going when JAX's notifier (which polls once a
# second) and the agreement have run; it stops long before the last.
ARGS = ["dataset_type=markov", "num_decoder_layers=2", "emb_dim=32", "per_device_batch_size=1",
        "max_target_length=16", "remat_policy=none", "enable_tensorboard=false", "steps=2000",
        "ici_fsdp_parallelism=2", "hardware=cpu", "ici_expert_parallelism=2",
        "dcn_expert_parallelism=2", "checkpoint_period=1000"]


def test_sigterm_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
    address = f"localhost:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dropless", "train", f"base_output_directory={tmp_path}", "run_name=mp",
             *ARGS],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
        for i in range(2)
    ]
    metrics = tmp_path / "mp" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no steps"
            time.sleep(0.05)
        procs[1].terminate()  # SIGTERM, to process 1 only
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [[line for line in out.splitlines() if line.startswith("dropless: ")] for out in outs]
    assert [p.returncode for p in procs] == [143, 143], outs[1][-3000:]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    ckpt = tmp_path / "mp" / "checkpoints"
    (step,) = ckpt_lib.complete_steps_in(str(ckpt))
    assert lines[0][0] == (f"dropless: preempted (SIGTERM) after step {step} of 2000; saved checkpoint "
                           f"{ckpt / str(step)}; the same command resumes from step {step}")
    assert _manifest_covers_every_file(ckpt / str(step))  # both processes' shards, sealed
    rows = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert rows == list(range(1, step + 1))
