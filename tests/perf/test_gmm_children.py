"""benchmarks/gmm.py's parent process: a run cut off by its limit keeps what it finished.

The parent runs one child per shape; each child saves its record after every
layout row. When ``timeout`` signals the parent (SIGTERM, turned into
``_Stopped``) while a child runs, the parent merges the rows that child saved,
writes the record with the cut shape under ``skipped``, and starts no other
child. Here ``subprocess.run`` is replaced: the first child finishes its shape,
the second saves one row and is then cut; the third must never start.
"""

import argparse
import json
import subprocess
from pathlib import Path

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]


def test_sigterm_keeps_the_finished_rows(tmp_path, monkeypatch):
    gmm = load_module("gmm", REPO / "benchmarks")
    started = []

    def fake_run(cmd, check, timeout):
        shape = cmd[cmd.index("--shape") + 1]
        part = Path(cmd[cmd.index("--inner") + 1])
        started.append(shape)
        row = {"M": 1, "G": int(shape.split(",")[1]), "K": 2, "N": 3, "layout": "balanced",
               "tflops": {}}
        part.write_text(json.dumps({"results": [row], "tuning_sweep": [], "tilings": {}}))
        if len(started) == 2:
            raise gmm._Stopped(15)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = argparse.Namespace(iters=1, impls="ours", out=str(tmp_path), commit="c", quant="none",
                              quick=False, smoke=False, tune=False, budget_s=0)
    shapes = [(1, 5, 2, 3), (1, 6, 2, 3), (1, 7, 2, 3)]
    gmm.run_children(args, shapes, {"results": [], "tuning_sweep": []})
    assert started == ["1,5,2,3", "1,6,2,3"]
    (path,) = tmp_path.glob("gmm-*.json")
    record = json.loads(path.read_text())
    assert [r["G"] for r in record["results"]] == [5, 6]
    assert record["skipped"] == [["--shape", "1,6,2,3"]]


def test_a_child_that_saved_nothing_still_gives_a_record(tmp_path, monkeypatch):
    gmm = load_module("gmm", REPO / "benchmarks")

    def fake_run(cmd, check, timeout):
        raise gmm._Stopped(15)

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = argparse.Namespace(iters=1, impls="ours", out=str(tmp_path), commit="c", quant="none",
                              quick=False, smoke=False, tune=False, budget_s=0)
    gmm.run_children(args, [(1, 5, 2, 3)], {"results": [], "tuning_sweep": []})
    (path,) = tmp_path.glob("gmm-*.json")
    assert json.loads(path.read_text())["skipped"] == [["--shape", "1,5,2,3"]]
