"""``python -m dropless train`` on CPU: two processes joined by ``jax.distributed``
(gloo) train like one process of 8 devices.

Each of the two processes has 4 devices; the mesh is fsdp=2 x expert=4 with
the expert axis across the processes (so expert parallelism crosses them, and
each process holds the non-contiguous batch sequences {0, 1, 4, 5} or
{2, 3, 6, 7}). The reference is one process with 8 devices and the same mesh.
Checked:

* each process made only the rows its devices hold (``rows_at`` is logged);
* the run is stopped right after its step-2 checkpoint (Orbax, every process
  writing its own shards; each process CRCs half the files, process 0 writes
  the manifest, which names every file), both processes are
  started again on the run directory, resume from step 2 and finish;
* the losses of all 4 steps equal those of one process with 8 devices and the
  same mesh and global batch, within float tolerance (gloo sums in another
  order).

Also: checkpoint verification at restore is split between the processes
(each CRCs every other file) and a bad file fails both with one message.

XLA:CPU compiles at optimisation level 0; the model is deepseek3-tiny cut down.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from dropless.train import checkpoint as ckpt_lib

REPO = Path(__file__).resolve().parents[2]
STEPS, ACCUM, BATCH = 4, 2, 8
ARGS = ["dataset_type=markov", "num_decoder_layers=2", "emb_dim=32", "per_device_batch_size=1",
        f"gradient_accumulation_steps={ACCUM}", "max_target_length=16", "remat_policy=none",
        "enable_tensorboard=false", f"steps={STEPS}", "ici_fsdp_parallelism=2"]

# Logs every rows_at call; with a stop step, exits right after that checkpoint
# is saved and sealed in every process, as a preempted job would (no cleanup).
_CHILD = """
import json, os, sys
from dropless.train import checkpoint as ckpt_lib, data as data_lib
log, stop_at = sys.argv[1], int(sys.argv[2])
rows_at = data_lib.MarkovSource.rows_at
def logged(self, step, rows):
    with open(log, "a") as f:
        f.write(json.dumps([step, [int(r) for r in rows]]) + "\\n")
    return rows_at(self, step, rows)
data_lib.MarkovSource.rows_at = logged
save = ckpt_lib.Checkpointer.save
def save_then_stop(self, step, state, *, force=False):
    saved = save(self, step, state, force=force)
    if step == stop_at:
        self.wait()
        print("STOPPED", step, flush=True)
        os._exit(0)
    return saved
ckpt_lib.Checkpointer.save = save_then_stop
from dropless.cli import main
raise SystemExit(main(["train", *sys.argv[3:]]))
"""


# Checks each step directory given with verify_everywhere and prints the outcome.
_VERIFY_CHILD = """
import sys
from dropless.parallel import distributed
distributed.set_cpu_devices(1)
distributed.initialize(cpu=True)
from dropless.train import checkpoint as ckpt_lib
for step_dir in sys.argv[1:]:
    try:
        ckpt_lib.verify_everywhere(step_dir)
        print("VERIFIED ok", flush=True)
    except ckpt_lib.CheckpointError as e:
        print("VERIFIED " + str(e), flush=True)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _job(argv_of, what: str) -> list[str]:
    """Run ``argv_of(i)`` as processes 0 and 1 of one job; their outputs (asserting exit 0)."""
    address = f"localhost:{_free_port()}"
    procs = [
        subprocess.Popen(
            argv_of(i), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)))
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
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{what}, process {i}:\n{out[-4000:]}"
    return outs


def _two_processes(tmp_path, phase: str, stop_at: int, args: list[str]) -> list[str]:
    """The training child as a job of two processes, logging rows to rows-<phase>-<i>.jsonl."""
    return _job(lambda i: [sys.executable, str(tmp_path / "child.py"),
                           str(tmp_path / f"rows-{phase}-{i}.jsonl"), str(stop_at), *args], phase)


def _rows_by_step(path: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for line in path.read_text().splitlines():
        step, rows = json.loads(line)
        out.setdefault(step, []).extend(rows)
    return out


def _manifest_covers_every_file(step_dir: Path) -> bool:
    """The manifest (CRCs from both processes' shares) names every file of the step."""
    listed = json.loads((step_dir / ckpt_lib.MANIFEST).read_text())["files"]
    on_disk = [str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
               if p.is_file() and p.name != ckpt_lib.MANIFEST]
    return sorted(listed) == sorted(on_disk) and len(on_disk) > 2


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_load_their_rows_checkpoint_resume_and_match_one_process(tmp_path):
    (tmp_path / "child.py").write_text(_CHILD)
    # The reference runs alongside (the two-process runs leave cores idle while they wait).
    one = subprocess.Popen(
        [sys.executable, "-m", "dropless", "train", f"base_output_directory={tmp_path}", "run_name=one",
         "ici_expert_parallelism=4", "enable_checkpointing=false", *ARGS],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    run = [f"base_output_directory={tmp_path}", "run_name=mp", "hardware=cpu",
           "ici_expert_parallelism=2", "dcn_expert_parallelism=2", "checkpoint_period=2", *ARGS]
    first = _two_processes(tmp_path, "first", 2, run)
    assert all("STOPPED 2" in out for out in first)
    assert "'expert': 4" in first[0] and "'fsdp': 2" in first[0]
    ckpt = tmp_path / "mp" / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["2"] and _manifest_covers_every_file(ckpt / "2")

    second = _two_processes(tmp_path, "second", -1, run)
    assert all("resuming from" in out for out in second), second[0][-3000:]
    assert _manifest_covers_every_file(ckpt / str(STEPS))

    # Process i made rows a*B + s for its sequences s of each microbatch a, and no others.
    for phase, steps in (("first", [0, 1]), ("second", [2, 3])):
        made = [_rows_by_step(tmp_path / f"rows-{phase}-{i}.jsonl") for i in range(2)]
        for m in made:  # the first run may have prefetched step 2 before it stopped
            assert sorted(m) in (steps, steps + [steps[-1] + 1]), sorted(m)
        seqs = sorted(sorted({r % BATCH for r in m[steps[0]]}) for m in made)
        assert seqs == [[0, 1, 4, 5], [2, 3, 6, 7]]
        for m in made:
            for step in m:
                mine = {r % BATCH for r in m[step]}
                assert sorted(m[step]) == sorted(a * BATCH + s for a in range(ACCUM) for s in mine)

    try:
        one_out = one.communicate(timeout=600)[0]
    finally:
        if one.poll() is None:
            one.kill()
    assert one.returncode == 0, one_out[-4000:]
    assert "'expert': 4" in one_out and "'fsdp': 2" in one_out
    ref, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "mp")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for rows in (ref, got):
        assert all(r["applied"] and r["overflow_tokens"] == 0 and r["ep_rows_sent"] > 0 for r in rows)
        assert rows[-1]["loss"] < rows[0]["loss"]
    for key in ("loss", "lm_loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in ref], rtol=2e-5, err_msg=key)


def test_checkpoint_verification_is_split_and_agreed_between_processes(tmp_path):
    """Each process checks every other file; a bad file in process 1's share fails both alike."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    for step_dir in (good, bad):
        step_dir.mkdir()
        for name in "abcd":
            (step_dir / name).write_bytes(name.encode() * 100)
        ckpt_lib.write_manifest(str(step_dir))
    (bad / "b").write_bytes(b"B" * 100)  # same size, other bytes: file 1, process 1's share
    (tmp_path / "verify.py").write_text(_VERIFY_CHILD)
    outs = _job(lambda i: [sys.executable, str(tmp_path / "verify.py"), str(good), str(bad)], "verify")
    results = [[line for line in out.splitlines() if line.startswith("VERIFIED ")] for out in outs]
    assert results[0] == results[1], outs
    assert results[0][0] == "VERIFIED ok"
    assert f"checkpoint {bad} is corrupt: b fails its CRC32" in results[0][1]
    assert results[0][1].endswith("(checked by process 1)")
