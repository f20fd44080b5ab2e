"""End to end: the loss falls toward the Markov entropy, the run writes its
outputs, and a run killed with SIGKILL resumes to bitwise the same losses.
"""

import dataclasses
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from rich.console import Console

from dropless.config.loader import ConfigError
from dropless.config.sections import DataConfig, MeshConfig
from dropless.train import checkpoint as ckpt_lib
from dropless.train import loop as loop_lib
from dropless.train import metrics as metrics_lib
from dropless.train.loop import build, run_training

STEPS = 60
PERIOD = 10


def _quiet():
    return Console(file=io.StringIO(), width=140)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_model, make_train):
    """An uninterrupted run: (train config, result, console text)."""
    train = make_train(tmp_path_factory.mktemp("reference"), steps=STEPS, checkpoint_period=PERIOD)
    console = _quiet()
    result = run_training(small_model, train, MeshConfig(), console=console)
    return train, result, console.file.getvalue()


def test_loss_falls_toward_the_source_entropy(reference):
    train, result, text = reference
    rows = metrics_lib.read_jsonl(result.metrics_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    initial = sum(r["lm_loss"] for r in rows[:3]) / 3
    assert result.ok and result.skipped_steps == 0 and result.final_step == STEPS
    assert result.final_lm_loss_avg < initial - 0.5, (initial, result.final_lm_loss_avg)
    # Below the entropy rate only by sampling noise of a finite batch.
    assert result.final_lm_loss_avg > result.entropy_floor - 0.1
    assert f"{result.entropy_floor:.4f}" in text and "dropless training summary" in text


def test_final_lm_loss_is_the_mean_of_the_last_tenth(reference):
    """The summary's "final LM loss (mean of last 10%)": STEPS=60 rows -> the last 6;
    fewer than 10 rows -> the last one."""
    _, result, _ = reference
    rows = metrics_lib.read_jsonl(result.metrics_path)
    assert result.final_lm_loss_avg == pytest.approx(sum(r["lm_loss"] for r in rows[-6:]) / 6, rel=1e-12)
    assert metrics_lib.final_lm_loss(rows[:9]) == rows[8]["lm_loss"]
    assert metrics_lib.final_lm_loss([]) is None


def test_run_outputs(reference):
    train, result, _ = reference
    run_dir = os.path.join(train.base_output_directory, train.run_name)
    assert result.run_dir == os.path.abspath(run_dir)
    assert os.path.getsize(os.path.join(run_dir, "summary.png")) > 10_000
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run_dir, "tensorboard")))
    assert os.path.exists(os.path.join(run_dir, "config.json"))
    ckpt = ckpt_lib.Checkpointer(os.path.join(run_dir, "checkpoints"), period=PERIOD)
    assert ckpt.complete_steps() == list(range(PERIOD, STEPS + 1, PERIOD))
    ckpt.close()
    row = metrics_lib.read_jsonl(result.metrics_path)[-1]
    for key in ("loss", "grad_norm", "learning_rate", "tflops_per_device", "tokens_per_s",
                "moe_load_cv", "moe_tokens_min", "moe_tokens_max", "dropped_tokens", "skipped_steps"):
        assert key in row, key
    assert row["dropped_tokens"] == 0  # dropless
    assert result.tflops_per_device > 0 and result.mfu is None  # CPU: no peak, no MFU
    # The provenance record: where it ran, on which code, with which config, and the summary.
    with open(result.record_path) as f:
        record = json.load(f)
    assert os.path.dirname(result.record_path) == os.path.join(result.run_dir, "records")
    assert record["kind"] == "train" and record["device"]["platform"] == "cpu"
    assert record["versions"]["jax"] == jax.__version__ and record["commit"]
    assert record["config"]["train"]["run_name"] == train.run_name
    assert record["tflops_per_device"] == result.tflops_per_device
    assert record["final_step"] == result.final_step == STEPS and record["tflop_per_step_device"] > 0


def test_checkpoint_saves_report_their_blocking_time(reference):
    """Each save's time holding the loop is on the next step's row (in no step time)
    and summed in the result; the last save has no next row."""
    _, result, text = reference
    rows = metrics_lib.read_jsonl(result.metrics_path)
    reported = [r for r in rows if "checkpoint_blocked_s" in r]
    assert [r["step"] for r in reported] == list(range(PERIOD + 1, STEPS, PERIOD))
    for r in reported:
        assert 0 <= r["checkpoint_wait_s"] <= r["checkpoint_blocked_s"]
    assert result.checkpoint_saves == STEPS // PERIOD
    assert result.checkpoint_blocked_s >= sum(r["checkpoint_blocked_s"] for r in reported)
    assert "checkpoint saves" in text


def test_step_times_are_window_means(reference):
    """Timing windows end at every printed step (STEPS // 10 = 6), every
    TIMING_WINDOW_STEPS-th step and every save (PERIOD); each timed row says how many
    steps it averages, the first step's row has its compile time and no step time,
    and the windows add up to no more than the run's wall time. (The bounds against
    the device time are in test_step_timing, on a simulated device.)"""
    _, result, text = reference
    rows = metrics_lib.read_jsonl(result.metrics_path)
    ends = sorted({s for s in range(1, STEPS + 1)
                   if s % 6 == 0 or s % loop_lib.TIMING_WINDOW_STEPS == 0 or s % PERIOD == 0})
    timed = [r for r in rows if "step_time_s" in r]
    assert [r["step"] for r in timed] == ends
    assert [r["step_time_steps"] for r in timed] == [b - a for a, b in zip([1] + ends, ends)]
    assert "compile_s" in rows[0] and "step_time_s" not in rows[0]
    assert rows[0]["compile_s"] == result.compile_s
    assert sum(r["step_time_s"] * r["step_time_steps"] for r in timed) + result.compile_s < result.wall_s
    assert f"mean of steps {STEPS - 5}-{STEPS}" in text


_CHILD = """
import json, pickle, sys
from dropless.config.sections import MeshConfig
from dropless.train.loop import run_training
model, train = pickle.load(open(sys.argv[1], "rb"))
r = run_training(model, train, MeshConfig())
print("RESULT " + json.dumps({"resumed_from": r.resumed_from, "final_step": r.final_step}))
"""


def _spawn(tmp_path, model, train, name):
    """Start ``run_training(model, train)`` in a fresh process with pinned XLA flags.

    Every run compared bitwise runs this way: the test process's own backend
    may have started with other flags (whichever test touched JAX first).
    """
    (tmp_path / f"{name}.pkl").write_bytes(pickle.dumps((model, train)))
    (tmp_path / "child.py").write_text(_CHILD)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path / f"{name}.pkl")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def _result(proc) -> dict:
    out = proc.communicate(timeout=600)[0].decode()
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _kill_after_first_checkpoint(proc, ckpt_dir, timeout=300):
    """SIGKILL ``proc`` as soon as a complete checkpoint exists; returns its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc={proc.returncode}) before it could be killed:\n"
                        + proc.stdout.read().decode()[-3000:])
        steps = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(ckpt_dir) else []
        done = [s for s in steps if os.path.exists(os.path.join(ckpt_dir, str(s), ckpt_lib.MANIFEST))]
        if done:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return max(done)
        time.sleep(0.01)
    proc.kill()
    pytest.fail("no checkpoint appeared")


def test_resume_after_sigkill_gives_identical_losses(small_model, make_train, tmp_path):
    def train(name):
        return make_train(tmp_path / name, steps=STEPS, checkpoint_period=PERIOD,
                          enable_tensorboard=False)

    uninterrupted = _spawn(tmp_path, small_model, train("whole"), "whole")
    killed = _spawn(tmp_path, small_model, train("killed"), "killed")
    killed_at = _kill_after_first_checkpoint(killed, str(tmp_path / "killed" / "run" / "checkpoints"))
    assert killed.returncode == -signal.SIGKILL
    resumed = _result(_spawn(tmp_path, small_model, train("killed"), "killed"))
    _result(uninterrupted)
    assert resumed["resumed_from"] is not None and killed_at <= resumed["resumed_from"] < STEPS
    ref = metrics_lib.read_jsonl(str(tmp_path / "whole" / "run" / "metrics.jsonl"))
    got = metrics_lib.read_jsonl(str(tmp_path / "killed" / "run" / "metrics.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for key in ("loss", "lm_loss", "grad_norm", "learning_rate"):
        assert [r[key] for r in got] == [r[key] for r in ref], key  # bitwise


def test_load_parameters_path_starts_from_trained_weights(reference, small_model, make_train, tmp_path):
    train, ref_result, _ = reference
    # steps=STEPS: the reference's step program, so no second compile; only the first
    # step's loss is compared.
    fresh = make_train(tmp_path, steps=STEPS, enable_checkpointing=False, enable_tensorboard=False,
                       load_parameters_path=os.path.join(ref_result.run_dir, "checkpoints", str(STEPS)))
    result = run_training(small_model, fresh, MeshConfig(), console=_quiet())
    assert result.initial_loss < ref_result.initial_loss - 0.5


def test_setup_errors_come_before_any_work(small_model, make_train, tmp_path):
    bad_data = make_train(tmp_path, data=DataConfig(dataset_type="text", dataset_path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="data: dataset_path=.*no such file or directory"):
        run_training(small_model, bad_data, MeshConfig(), console=_quiet())
    with pytest.raises(ValueError, match="whole number"):
        run_training(small_model, make_train(tmp_path, per_device_batch_size=0.5), MeshConfig(),
                     console=_quiet())
    assert not os.path.exists(tmp_path / "run")


def test_build_gives_a_steppable_trainer(small_model, make_train, tmp_path):
    one_layer = dataclasses.replace(small_model, num_decoder_layers=1, first_num_dense_layers=1)
    # steps=3: the trainer of the test below, compiled once for both.
    built = build(one_layer, make_train(tmp_path, per_device_batch_size=2, steps=3), MeshConfig())
    state, metrics = built.step_fn(built.state, next(built.batches))
    assert int(state["step"]) == 1 and float(metrics["loss"]) > 0
    assert built.tflops_per_step > 0 and built.global_batch == 2


def test_build_run_is_the_steps_by_hand(small_model, make_train, tmp_path):
    """``Built.run`` (the trainer's loop, no files) from the same initialisation and batches
    gives, row by row, the losses of ``step_fn`` stepped by hand: exact, the same jitted
    computation on the same inputs."""
    one_layer = dataclasses.replace(small_model, num_decoder_layers=1, first_num_dense_layers=1)
    train = make_train(tmp_path, per_device_batch_size=2, steps=3)
    by_hand = build(one_layer, train, MeshConfig())
    state, losses = by_hand.state, []
    for _ in range(train.steps):
        state, metrics = by_hand.step_fn(state, next(by_hand.batches))
        losses.append(float(metrics["loss"]))
    built = build(one_layer, train, MeshConfig())
    ran = built.run(built.state, _quiet())
    assert [r["step"] for r in ran.rows] == [1, 2, 3]
    assert [r["loss"] for r in ran.rows] == losses
    assert int(ran.state["step"]) == 3 and not os.path.exists(tmp_path / "run")


def test_incomplete_checkpoints_are_rerun_and_saved_again(reference, small_model, tmp_path):
    train, ref_result, _ = reference
    shutil.copytree(ref_result.run_dir, tmp_path / "run")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    for step in (STEPS - PERIOD, STEPS):  # as if killed before their manifests were written
        os.remove(ckpt_dir / str(step) / ckpt_lib.MANIFEST)
    train = train.__class__(**{**train.__dict__, "base_output_directory": str(tmp_path)})
    result = run_training(small_model, train, MeshConfig(), console=_quiet())
    assert result.resumed_from == STEPS - 2 * PERIOD and result.steps_run == 2 * PERIOD
    ckpt = ckpt_lib.Checkpointer(str(ckpt_dir), period=PERIOD)
    assert ckpt.complete_steps() == list(range(PERIOD, STEPS + 1, PERIOD))
    ckpt.close()
    ref = metrics_lib.read_jsonl(ref_result.metrics_path)
    got = metrics_lib.read_jsonl(result.metrics_path)
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]


def test_fp8_run_says_once_which_dense_matmuls_stay_bf16(reference, small_model, make_train, tmp_path):
    """quantization=te_fp8_currentscaling with fp8_min_dim above the small model's dims: the
    start of the run names the bf16 matmuls in one line, once; a bf16 run says nothing of it."""
    one_layer = dataclasses.replace(small_model, num_decoder_layers=1, first_num_dense_layers=1,
                                    quantization="te_fp8_currentscaling", fp8_min_dim=4096)
    console = _quiet()
    run_training(one_layer, make_train(tmp_path, steps=1, enable_checkpointing=False,
                                       enable_tensorboard=False), MeshConfig(), console=console)
    lines = [ln for ln in console.file.getvalue().splitlines() if "fp8_min_dim" in ln]
    assert len(lines) == 1, lines
    assert "fp8_min_dim=4096: " in lines[0] and "mlp/wi_0 16x32" in lines[0]
    assert lines[0].endswith("fp8_min_dim=0 quantizes them all")
    assert "fp8_min_dim" not in reference[2]


def test_custom_remat_run_says_once_which_fp8_codes_it_recomputes(small_model, make_train,
                                                                  tmp_path):
    """remat_policy=custom under FP8 dense products without ``fp8_dot_codes`` listed: the
    start of the run says so in one line (``remat.fp8_codes_recomputed_line``)."""
    one_layer = dataclasses.replace(small_model, num_decoder_layers=1, first_num_dense_layers=1,
                                    quantization="te_fp8_currentscaling", fp8_min_dim=0,
                                    remat_policy="custom",
                                    remat_custom=(("decoder_layer_input", "device"),))
    console = _quiet()
    run_training(one_layer, make_train(tmp_path, steps=1, enable_checkpointing=False,
                                       enable_tensorboard=False), MeshConfig(), console=console)
    lines = [ln for ln in console.file.getvalue().splitlines() if "remat_policy=custom" in ln]
    assert len(lines) == 1, lines
    assert "does not keep fp8_dot_codes (the FP8 dense products)" in lines[0]
