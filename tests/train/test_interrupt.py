"""Ctrl-C (SIGINT) during ``dropless train``: one line saying where the run
stopped and which checkpoint the same command resumes from, exit code 130,
no traceback; the rerun resumes from that checkpoint.

The interrupt is raised from inside the step function, where Python delivers
a SIGINT that arrives while XLA runs a step (at the next bytecode after the
call returns). A small model (2 layers, width 16) keeps both runs to seconds.
"""

import os

from dropless import cli
from dropless.train import checkpoint as ckpt_lib
from dropless.train import loop

SMALL = ["model_name=deepseek3-tiny", "num_decoder_layers=2", "emb_dim=16", "mlp_dim=32",
         "moe_mlp_dim=16", "num_query_heads=2", "q_lora_rank=8", "kv_lora_rank=8",
         "qk_nope_head_dim=8", "qk_rope_head_dim=4", "v_head_dim=8", "max_target_length=16",
         "per_device_batch_size=4", "vocab_size=32", "enable_tensorboard=false"]


def before_call(monkeypatch, n: int, act):
    """Run ``act()`` just before the ``n``-th call of the train step."""
    real = loop._jit_step

    def jit_step(s):
        step_fn, calls = real(s), [0]

        def step(state, batch):
            calls[0] += 1
            if calls[0] == n:
                act()
            return step_fn(state, batch)

        return step

    monkeypatch.setattr(loop, "_jit_step", jit_step)


def _interrupt_at_call(monkeypatch, n: int):
    """Make the ``n``-th call of the train step raise KeyboardInterrupt."""

    def interrupt():
        raise KeyboardInterrupt

    before_call(monkeypatch, n, interrupt)


def test_ctrl_c_names_the_checkpoint_and_the_same_command_resumes(capsys, tmp_path, monkeypatch):
    args = ["train", *SMALL, "steps=8", "checkpoint_period=2", f"base_output_directory={tmp_path}",
            "run_name=r"]
    # Steps 1-5 ran; step 5's metrics row is written while step 6 runs, so 4 is the
    # last recorded step, and the newest save.
    _interrupt_at_call(monkeypatch, 6)
    code = cli.main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 130, err
    assert len(lines) == 1 and "Traceback" not in err, lines
    ckpt_dir = os.path.join(tmp_path, "r", "checkpoints")
    assert ckpt_lib.complete_steps_in(ckpt_dir) == [2, 4]  # the save in flight was finished
    for needle in ("interrupted after step 4 of 8", os.path.join(ckpt_dir, "4"), "same command"):
        assert needle in lines[0], (needle, lines[0])

    monkeypatch.undo()
    assert cli.main(args) == 0
    out = "".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert f"resumingfrom{os.path.join(ckpt_dir, '4')}" in out and "8(4thisrun,resumedfrom4)" in out


def test_ctrl_c_of_a_run_without_run_name_names_the_run(capsys, tmp_path, monkeypatch):
    """Without run_name a rerun would start a new run: the line gives the name to resume with;
    before the first save there is no checkpoint, and the line says so. (Interrupted before
    the first step is called, so nothing compiles.)"""
    _interrupt_at_call(monkeypatch, 1)
    code = cli.main(["train", *SMALL, "steps=8", "checkpoint_period=4", f"base_output_directory={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 130 and "\n" not in err, err
    (name,) = os.listdir(tmp_path)
    for needle in ("before step 1 finished", f"run_name={name}", "no checkpoint saved yet"):
        assert needle in err, (needle, err)


def test_ctrl_c_elsewhere_is_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "config", (interrupted, ""))
    assert cli.main(["config"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "dropless: interrupted", err


def test_the_compile_is_announced_before_it_starts(capsys, tmp_path, monkeypatch):
    """The first step compiles (minutes for a large model) and a log shows no progress bar:
    a line says so before it starts. (Stopped at the first call: nothing compiles here.)"""
    _interrupt_at_call(monkeypatch, 1)
    assert cli.main(["train", *SMALL, "steps=8", f"base_output_directory={tmp_path}", "run_name=r"]) == 130
    out = capsys.readouterr().out
    assert "step 1: compiling the train step" in " ".join(out.split()), out
