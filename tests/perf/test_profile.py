"""``dropless profile`` end to end on CPU with the tiny DeepSeek-V3 config.

Runs the real CLI in a subprocess (it sets JAX's platform and flags before
JAX starts), then checks the files it promises: the trace, breakdown.json
with consistent percentages, and the PNG.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.perf import profile

REPO = Path(__file__).parents[2]


def test_parse_args_splits_flags_from_overrides():
    ns, rest = profile.parse_args(["cfg.yml", "--steps", "4", "a=1", "--warmup=0", "b=2"])
    assert (ns.steps, ns.warmup, ns.top) == (4, 0, 15) and rest == ["cfg.yml", "a=1", "b=2"]
    with pytest.raises(SystemExit):
        profile.parse_args(["--stepz", "3"])
    with pytest.raises(SystemExit):
        profile.parse_args(["--steps", "0"])


def test_profile_end_to_end_cpu(tmp_path):
    try:
        from dropless.train.loop import build  # noqa: F401 - what profile steps through
    except ImportError as e:
        pytest.skip(f"the trainer does not expose dropless.train.loop.build: {e}")
    args = ["profile", "model_name=deepseek3-tiny", "hardware=cpu", "per_device_batch_size=2",
            "max_target_length=32", "dataset_type=synthetic", f"base_output_directory={tmp_path}",
            "run_name=prof", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "results")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "dropless", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "prof" / "profile"
    data = json.loads((out / "breakdown.json").read_text())
    assert data["steps"] == 2 and data["platform"] == "cpu"
    assert math.isclose(sum(c["pct_kernel"] for c in data["categories"]), 100.0)
    dense = next(c for c in data["categories"] if c["category"] == "dense_gemm")
    assert dense["time_us"] > 0
    assert data["config"]["model_name"] == "deepseek3-tiny" and data["step_ms"] > 0
    assert data["tflops_per_device_per_step"] > 0 and data["mfu_pct"] is None  # no CPU peak
    assert 0 < len(data["top_kernels"]) <= 15
    assert (out / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    assert list(out.glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert "Kernel time by category" in proc.stdout and "Top 15 kernels" in proc.stdout
    # The results record: provenance, the config's facts, ms per step per category.
    (path,) = (tmp_path / "results").glob("profile-*.json")
    record = json.loads(path.read_text())
    assert record["kind"] == "profile" and record["commit"]["commit"]
    assert record["config"]["model_name"] == "deepseek3-tiny"
    assert record["config"]["precision"] == "bf16" and record["steps"] == 2
    rows = {r["category"]: r for r in record["rows"]}
    assert set(rows) == {c["category"] for c in data["categories"]}
    assert math.isclose(sum(r["ms_per_step"] for r in rows.values()),
                        data["kernel_us"] / 2 / 1e3, rel_tol=1e-9)
    assert rows["dense_gemm"]["pct_kernel"] == dense["pct_kernel"]
    assert record["tflops_per_device"] > 0 and record["step_ms"] == data["step_ms"]
    assert list((out / "hlo").glob("*after_optimizations.txt"))  # what names the kernels' ops


def test_precision_from_quantization_keys():
    assert profile.precision({"quantization": "", "te_gmm_quantization": "te_no_quant"}) == "bf16"
    assert profile.precision({"quantization": "te_fp8_currentscaling",
                              "te_gmm_quantization": "te_no_quant"}) == "fp8"
    assert profile.precision({"quantization": "", "te_gmm_quantization": "te_fp8_blockwise"}) == "fp8"


def test_unwritable_out_is_one_line(tmp_path):
    """--out under a file: exit 2 with one line, before JAX compiles anything."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "-m", "dropless", "profile", "model_name=deepseek3-tiny",
                           "hardware=cpu", "--out", str(blocker / "results")], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("dropless profile: --out ")
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
