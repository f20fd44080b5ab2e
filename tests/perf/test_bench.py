"""``dropless bench`` driving fake benchmark modules on CPU.

The fake ``benchmarks/`` directory has the three call styles bench supports:
``gmm.py`` with an argument-less ``main()`` that parses ``sys.argv`` (as the
real one does), ``moe_layer.py`` with ``run(quick, out_dir)``, and a
``step.py`` whose ``main(argv)`` rejects ``--commit`` (argparse exit 2) so
bench must call it again without. A missing benchmark is an error entry.
"""

import json
import textwrap

import pytest

from dropless.perf import bench

GMM = '''
import argparse, json, pathlib, sys
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true"); p.add_argument("--out")
    p.add_argument("--commit", default="unknown")
    a = p.parse_args()
    rec = {"benchmark": "gmm", "gpu": "cpu", "jax": "0.11.2", "commit": a.commit, "quick": a.quick,
           "results": [{"M": 64, "G": 2, "K": 8, "N": 8, "layout": "balanced",
                        "tflops": {"ours": {"fwd": 1.0}, "dense": {"fwd": 2.0}}}]}
    pathlib.Path(a.out, "gmm-2026-11-29-cpu.json").write_text(json.dumps(rec))
'''
MOE = '''
import json, pathlib
from dropless.perf import measure
def run(quick, out_dir):
    rec = measure.new_record("moe_layer", {"quick": quick, "tiny": True})
    rec["rows"] = [{"case": "ours", "backend": "xla", "fwd_ms": 1.0, "fwd_bwd_ms": 3.0,
                    "dropped_fraction": 0.0}]
    rec["path"] = str(measure.write_record(rec, out_dir))
    return rec
'''
STEP = '''
import argparse, json, pathlib
from dropless.perf import measure
def main(argv):
    p = argparse.ArgumentParser(); p.add_argument("--out"); p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    rec = measure.new_record("step", {})
    rec["rows"] = [{"name": "xla baseline", "tflops_per_device": 1.0},
                   {"name": "ours", "tflops_per_device": 10.0}]
    measure.write_record(rec, a.out)
    return 0
'''


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "gmm.py").write_text(textwrap.dedent(GMM))
    (d / "moe_layer.py").write_text(textwrap.dedent(MOE))
    return d


def test_bench_runs_all_styles_and_reports_failures(bench_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = tmp_path / "results"
    code = bench.main(["--quick", "--out", str(out), "--benchmarks-dir", str(bench_dir),
                       "--only", "gmm,moe_layer,step"])
    assert code == 1  # step.py is missing
    [bundle_path] = [p for p in out.glob("*.json") if p.name[0].isdigit()]
    bundle = json.loads(bundle_path.read_text())
    assert bundle["kind"] == "bench" and bundle["config"]["quick"] is True
    records = bundle["records"]
    assert records["gmm"]["quick"] is True and records["gmm"]["commit"] == bundle["commit"]["commit"]
    assert records["moe_layer"]["rows"][0]["fwd_bwd_ms"] == 3.0
    assert "step.py not found" in records["step"]["error"]
    assert set(bundle["seconds"]) == {"gmm", "moe_layer", "step"}
    assert (out / "RESULTS.md").exists()  # rendered next to the results when --out is given
    text = capsys.readouterr().out
    assert "dropless bench on" in text and "step.py not found" in text


def test_bench_retries_without_unknown_flags(bench_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    (bench_dir / "step.py").write_text(textwrap.dedent(STEP))
    out = tmp_path / "results"
    code = bench.main(["--out", str(out), "--only", "step", "--benchmarks-dir", str(bench_dir)])
    bundle = json.loads(next(p for p in out.glob("*.json") if p.name[0].isdigit()).read_text())
    assert code == 0 and bundle["records"]["step"]["rows"][1]["name"] == "ours"


def test_bench_rejects_unknown_benchmarks(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--only", "nope", "--out", str(tmp_path)])


def test_real_benchmarks_tiny_and_quick(tmp_path):
    # The real moe_layer.py, step.py, fp8_quant.py and fp8_dense.py through bench with
    # --tiny --quick: every flag bench
    # passes must be accepted and every record must come back (a --quick that step.py
    # rejected once failed the whole step benchmark). gmm.py's --smoke mode runs Pallas
    # interpret mode, too slow for the suite.
    out = tmp_path / "results"
    code = bench.main(["--tiny", "--quick", "--only", "moe_layer,step,fp8_quant,fp8_dense",
                       "--out", str(out), "--md", str(tmp_path / "RESULTS.md")])
    bundle = json.loads(next(p for p in out.glob("*.json") if p.name[0].isdigit()).read_text())
    assert code == 0, {k: r.get("error") for k, r in bundle["records"].items()}
    step = bundle["records"]["step"]
    assert [r["case"] for r in step["cases"]] == ["xla", "capacity", "ours"]
    assert all("step_time_s" in r for r in step["cases"])
    assert bundle["records"]["moe_layer"]["config"]["tiny"] is True
    assert bundle["records"]["fp8_quant"]["kind"] == "fp8_quant"
    assert {r["name"] for r in bundle["records"]["fp8_dense"]["rows"]} >= {"mla.wq_a", "shared.wo"}
