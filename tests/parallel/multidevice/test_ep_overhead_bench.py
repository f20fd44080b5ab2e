"""benchmarks/ep_overhead.py runs end to end (--tiny, 8 CPU devices: its multi-device part too)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import ep_overhead  # noqa: E402


def test_tiny_run_writes_a_record(tmp_path):
    assert ep_overhead.main(["--tiny", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("ep_overhead-*.json")
    record = json.loads(path.read_text())
    assert record["versions"]["jax"] and record["commit"]["commit"]
    assert record["outputs_identical"] is True
    # expert=1 compiles to the same program as the block without a mesh.
    assert record["hlo_instructions"]["ep1"] == record["hlo_instructions"]["local"]
    assert all(c["values_ok"] and c["grad_ok"] for c in record["ragged_exchange"])
    multi = record["multi_gpu"]
    assert multi["devices"] == 8
    assert all(e["max_abs_err_y"] < 1e-4 and e["max_abs_err_dx"] < 1e-4
               for e in multi["equivalence"])
    assert {r["pass"] for r in record["rows"]} == {"fwd", "fwd_bwd"}
    assert {(t["impl"], t["pipeline_chunks"]) for t in multi["timing"]} == {
        ("padded", 1), ("padded", 2)}
    assert record["config"]["xla_flags_applied"] == []  # flags go to GPUs only
