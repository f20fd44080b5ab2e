"""The command line: every runtime problem a user can cause exits 2 with one
line on stderr naming the key and what is allowed; ``--debug`` shows the
traceback instead. Each case stops before anything compiles, so the CLI runs
in this process (``cli.main`` returns the exit code).
"""

import os
import socket
from types import SimpleNamespace

import jax
import pytest

from dropless import cli
from dropless.config.loader import ConfigError, load_config
from dropless.train import loop
from dropless.train import run_dir as run_dir_lib


def _train(capsys, tmp_path, *overrides):
    """(exit code, stderr lines) of ``dropless train`` on the tiny preset writing under tmp_path."""
    code = cli.main(["train", "model_name=deepseek3-tiny", "hardware=auto", "steps=2",
                     f"base_output_directory={tmp_path / 'runs'}", "run_name=r", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def _one_line_exit_2(code, lines, *needles):
    assert code == 2 and len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_text_data_without_a_path(capsys, tmp_path):
    _one_line_exit_2(*_train(capsys, tmp_path, "dataset_type=text"), "dataset_type=text needs dataset_path")


def test_missing_dataset_path(capsys, tmp_path):
    _one_line_exit_2(*_train(capsys, tmp_path, "dataset_type=text", f"dataset_path={tmp_path}/nope.txt"),
                     "dataset_path=", "no such file or directory")


def test_missing_tokenizer(capsys, tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    _one_line_exit_2(*_train(capsys, tmp_path, "dataset_type=text", f"dataset_path={tmp_path}/a.txt",
                             f"tokenizer_path={tmp_path}/tok.json"), "tokenizer_path=", "no such file")


def test_tokenizer_that_is_not_one(capsys, tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 50)
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    try:
        import tokenizers  # noqa: F401

        needle = "is not a tokenizer.json"
    except ImportError:
        needle = "needs the 'tokenizers' package"
    _one_line_exit_2(*_train(capsys, tmp_path, "dataset_type=text", f"dataset_path={tmp_path}/a.txt",
                             f"tokenizer_path={tmp_path}/tok.json"), "tokenizer_path", needle)


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="checks a machine without a GPU")
@pytest.mark.parametrize("overrides,needle", [
    (["gmm_backend=mosaic", "dtype=bfloat16"], "gmm_backend='mosaic' runs Mosaic GPU kernels"),
    (["attention=cudnn_flash_te", "dtype=bfloat16"], "attention='cudnn_flash_te' needs an NVIDIA GPU"),
])
def test_gpu_kernels_on_a_cpu_machine(capsys, tmp_path, overrides, needle):
    """hardware=auto on a machine without a GPU: refused at start, not in a traceback."""
    _one_line_exit_2(*_train(capsys, tmp_path, *overrides), needle, "allowed here")


@pytest.mark.parametrize("overrides,needle", [
    (["attention=cudnn_flash_te", "dtype=float32"], "set dtype=bfloat16 or attention=dot_product"),
    (["te_gmm_quantization=te_fp8_blockwise", "gmm_fp8_impl=kernel"], "multiples of 256"),
    (["te_moe_block=false"], "only true is allowed"),
    (["ici_tensor_parallelism=2"], "must be 1"),
])
def test_contradictions_in_the_keys(capsys, tmp_path, overrides, needle):
    _one_line_exit_2(*_train(capsys, tmp_path, *overrides), needle)
    assert not (tmp_path / "runs").exists()


def test_unwritable_output_directory(capsys, tmp_path):
    (tmp_path / "file").write_text("a file where a directory should be")
    code = cli.main(["train", "model_name=deepseek3-tiny", "steps=1", f"base_output_directory={tmp_path}/file"])
    _one_line_exit_2(code, capsys.readouterr().err.strip().splitlines(),
                     "base_output_directory=", "cannot write the run directory")


def test_out_of_memory_names_the_keys_to_lower(capsys, tmp_path, monkeypatch):
    """XLA's RESOURCE_EXHAUSTED (at compile or run time) becomes one line with the keys."""
    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.27GiB.\nmore detail")

    monkeypatch.setattr(loop, "_train_steps", oom)
    _one_line_exit_2(*_train(capsys, tmp_path, "remat_policy=minimal"), "out of device memory",
                     "allocate 81.27GiB", "per_device_batch_size=16", "max_target_length=64",
                     "remat_policy=minimal (full keeps the least)", "attention=dot_product")


def test_profile_out_of_memory_names_the_keys_to_lower(capsys, tmp_path, monkeypatch):
    """``dropless profile`` turns the same error into the same one line."""
    from dropless.perf import profile

    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 12.00GiB.")

    monkeypatch.setattr(profile, "capture", oom)
    code = cli.main(["profile", "model_name=deepseek3-tiny", "steps=2", "--out", str(tmp_path / "rec"),
                     f"base_output_directory={tmp_path / 'runs'}", "run_name=p"])
    _one_line_exit_2(code, capsys.readouterr().err.strip().splitlines(), "out of device memory",
                     "allocate 12.00GiB", "per_device_batch_size=")


def test_resume_with_another_config_is_refused(capsys, tmp_path):
    def recorded(*overrides):
        cfg = load_config(None, ["model_name=deepseek3-tiny", f"base_output_directory={tmp_path / 'runs'}",
                                 "run_name=r", *overrides], environ={}).config
        return run_dir_lib.sections_dict(cfg.model(), cfg.train(), cfg.mesh())

    run_dir = run_dir_lib.make_run_dir(str(tmp_path / "runs"), "r")
    run_dir_lib.record_config(run_dir, recorded("steps=2"), allow_change=False, primary=True)
    before = (tmp_path / "runs" / "r" / "config.json").read_text()
    _one_line_exit_2(*_train(capsys, tmp_path, "steps=3", "learning_rate=0.5"),
                     "holds a run with another config", "steps 2 -> 3", "learning_rate 0.01 -> 0.5",
                     "allow_config_change_on_resume=true")
    assert (tmp_path / "runs" / "r" / "config.json").read_text() == before


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="needs dataset_path"):
        cli.main(["train", "--debug", "dataset_type=text", f"base_output_directory={tmp_path}"])


def test_test_variables_do_not_stop_the_cli(capsys, monkeypatch):
    for name in ("DROPLESS_SLOW", "DROPLESS_CPU_DEVICES", "DROPLESS_COMMIT"):
        monkeypatch.setenv(name, "1")
    assert cli.main(["config", "run_name=123"]) == 0
    assert "'123'" in capsys.readouterr().out


# hardware=gpu_multiprocess (the seed recipe's) decides before jax.distributed.initialize.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "KUBERNETES_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR",
                      "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher's variables in os.environ (so no cluster); returns the list of calls
    to ``jax.distributed.initialize``, which records them instead of running."""
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    return calls


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="checks a machine without a GPU")
def test_gpu_multiprocess_without_a_cluster_or_a_gpu(capsys, tmp_path, no_launcher):
    """No cluster: jax.distributed is not started; no GPU either: refused in one line."""
    code, lines = _train(capsys, tmp_path, "hardware=gpu_multiprocess")
    assert no_launcher == []
    _one_line_exit_2(code, lines, "hardware='gpu_multiprocess' but JAX found no GPU", "hardware=auto or cpu")


def test_gpu_multiprocess_without_a_cluster_runs_as_one_process(capsys, tmp_path, no_launcher, monkeypatch):
    """On a host with GPUs (the CPU backend stands in for one here) the job of one
    process trains, and one line says so, naming what was looked for."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    started = []
    monkeypatch.setattr(loop, "run_training", lambda *a: started.append(a) or SimpleNamespace(ok=True))
    code = cli.main(["train", "model_name=deepseek3-tiny", "hardware=gpu_multiprocess", "steps=2",
                     f"base_output_directory={tmp_path / 'runs'}", "run_name=r"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and no_launcher == [] and len(started) == 1
    said = [line for line in out if "no cluster found" in line]
    n = jax.local_device_count()
    assert len(said) == 1 and said[0].startswith(
        "hardware=gpu_multiprocess: no cluster found (no JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/"
        "JAX_PROCESS_ID; JAX detects none of Open MPI, SLURM")
    assert said[0].endswith(f"running as one process on this host's {n} GPU{'s' * (n != 1)}")


def test_a_cluster_that_cannot_be_joined_is_one_line(capsys, tmp_path, monkeypatch):
    """A SLURM job step is found; JAX's real initialize fails (its backend has started
    in this process): one line naming SLURM and JAX's error, or the traceback with --debug."""
    jax.devices()
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                 "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    _one_line_exit_2(*_train(capsys, tmp_path, "hardware=gpu_multiprocess"),
                     "hardware=gpu_multiprocess: SLURM found, but jax.distributed.initialize failed: "
                     "RuntimeError:")
    with pytest.raises(ConfigError, match="SLURM found"):
        cli.main(["train", "--debug", "model_name=deepseek3-tiny", "hardware=gpu_multiprocess",
                  f"base_output_directory={tmp_path / 'runs'}"])


def test_jax_cache_dir_points_jax_at_the_directory(tmp_path, monkeypatch):
    """jax_cache_dir: ~ expands, the directory is created, JAX's compilation cache uses it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:
        path = cli.use_compilation_cache("~/cache/jax")
        assert path == str(tmp_path / "cache" / "jax") and os.path.isdir(path)
        assert jax.config.jax_compilation_cache_dir == path
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_jax_cache_dir_defaults_to_maxtexts_and_is_said(tmp_path, monkeypatch, capsys):
    """Unset, jax_cache_dir is MaxText's ~/jax_cache; the run names the directory once."""
    from dropless.config.loader import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["model_name=deepseek3-tiny"], environ={}).config
    assert cfg.jax_cache_dir == "~/jax_cache"
    before = jax.config.jax_compilation_cache_dir
    try:
        cli.start_runtime(cfg)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jax_cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert f"compilation cache: {tmp_path / 'jax_cache'} (jax_cache_dir; '' for none)" in \
        capsys.readouterr().out
    off = load_config(None, ["model_name=deepseek3-tiny", "jax_cache_dir="], environ={}).config
    assert off.jax_cache_dir == ""


def test_default_jax_cache_dir_that_cannot_be_made_runs_uncached_and_says_so(
        tmp_path, monkeypatch, capsys):
    """The default cache in a home where it cannot be made: one line, no error, no cache;
    the same directory asked for explicitly (another spelling) is an error."""
    from dropless.config.loader import load_config

    (tmp_path / "jax_cache").write_text("a file where the cache would go")
    monkeypatch.setenv("HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    cfg = load_config(None, ["model_name=deepseek3-tiny"], environ={}).config
    cli.start_runtime(cfg)
    assert jax.config.jax_compilation_cache_dir == before
    assert "compilation cache: off: jax_cache_dir='~/jax_cache': cannot use" in capsys.readouterr().out
    asked = load_config(None, ["model_name=deepseek3-tiny", f"jax_cache_dir={tmp_path}/jax_cache"],
                        environ={}).config
    with pytest.raises(ConfigError, match="cannot use .* as the compilation cache"):
        cli.start_runtime(asked)
    assert jax.config.jax_compilation_cache_dir == before


def test_jax_cache_dir_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(ConfigError, match=r"jax_cache_dir='.*file/jax': cannot use .* as the compilation cache"):
        cli.use_compilation_cache(str(tmp_path / "file" / "jax"))
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize("command, flags", [
    ("train", ["--dry-run", "--debug", "config.yml", "key=value", "dropless config --keys"]),
    ("config", ["--changed", "--keys", "--debug", "config.yml", "key=value"]),
])
@pytest.mark.parametrize("asked", ["--help", "-h"])
def test_help_lists_what_the_command_takes(capsys, command, flags, asked):
    assert cli.main([command, asked]) == 0
    out = capsys.readouterr().out
    assert f"usage: dropless {command}" in out, out
    for flag in flags:
        assert flag in out, (flag, out)


@pytest.mark.parametrize("command", ["train", "config"])
def test_an_unknown_option_is_not_taken_for_a_config_file(capsys, command):
    code = cli.main([command, "--stesp=3"])
    _one_line_exit_2(code, capsys.readouterr().err.strip().splitlines(), "unknown option --stesp=3",
                     f"dropless {command} --help")


def _undocumented(help_text: str) -> list[str]:
    """Options of an argparse help text with no description beside or below them."""
    lines = help_text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        said = "  " in line.strip()  # the description follows on the same line
        below = i + 1 < len(lines) and lines[i + 1].startswith("    ") and not lines[i + 1].strip().startswith("-")
        if not (said or below):
            bare.append(line.strip())
    return bare


# What each command takes besides its options: the config (file and keys) and, for
# profile, the dry run that train has too.
TAKES = {
    "bench": [],
    "profile": ["config.yml", "key=value", "--dry-run", "--debug"],
    "forward": ["config.yml", "key=value", "load_parameters_path", "hf_model_path", "--debug"],
    "export-hf": ["config.yml", "key=value", "(default bfloat16)", "--debug"],
    "tokenize": [],
}


@pytest.mark.parametrize("command", sorted(TAKES))
def test_every_option_says_what_it_does(capsys, command):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert _undocumented(out) == [], out
    for needle in TAKES[command]:
        assert needle in out, (needle, out)


def test_a_key_without_a_value_is_not_only_a_missing_file(capsys):
    """``train steps`` reads "steps" as the config file (the first argument without '='):
    the line says that a key needs =value."""
    _one_line_exit_2(cli.main(["train", "steps"]), capsys.readouterr().err.strip().splitlines(),
                     "config file steps not found", "key=value")


def test_top_level_help_lists_each_command_on_its_own_line(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for command, (_, about) in cli.COMMANDS.items():
        assert any(line.split()[:1] == [command] and about in line for line in lines), (command, lines)
    assert not any("``" in line for line in lines), lines
