"""tools/gpu_run.sh's bundling of $OUT: what a device call returns is at most 8 files,
counted in subfolders too, none more than 2 folders below $OUT. The GPU side (wheels,
nvidia-smi) is replaced by stubs on PATH; the commands only write files."""

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_run.sh"


def _run(tmp_path, command: str) -> Path:
    out, stubs = tmp_path / "out", tmp_path / "bin"
    out.mkdir()
    stubs.mkdir()
    for name, body in (("nvidia-smi", "echo 'NVIDIA H200, 1980 MHz'"), ("python3", "exit 1")):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {**os.environ, "OUT": str(out), "DROPLESS_COMMIT": "0" * 40,
           "PATH": f"{stubs}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(SCRIPT), command], env=env, check=True, capture_output=True, timeout=60)
    return out


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())


def _members(archive: Path) -> set[str]:
    with tarfile.open(archive) as tar:
        return {os.path.normpath(m.name) for m in tar.getmembers() if m.isfile()}


def test_few_files_come_back_as_they_are(tmp_path):
    out = _run(tmp_path, 'mkdir -p $OUT/r && touch $OUT/a.json $OUT/r/b.json')
    assert _files(out) == ["a.json", "logs.tgz", "r/b.json"]
    assert {"1--p.log", "gpu.txt", "setup.log"} <= _members(out / "logs.tgz")  # 1-<second word>.log


@pytest.mark.parametrize("command", [
    # 8 files beside logs.tgz, 6 of them in one folder (3 entries at the top).
    'mkdir -p $OUT/prof && touch $OUT/prof/1 $OUT/prof/2 $OUT/prof/3 $OUT/prof/4 $OUT/prof/5 '
    '$OUT/prof/6 $OUT/a.json $OUT/b.json',
    # one file 3 folders down, which the device would not return.
    'mkdir -p $OUT/a/b/c && touch $OUT/a/b/c/deep.json $OUT/x.json',
], ids=["files_in_a_folder", "too_deep"])
def test_what_would_not_come_back_is_bundled(tmp_path, command):
    out = _run(tmp_path, command)
    assert _files(out) == ["logs.tgz", "results.tgz"]
    inside = _members(out / "results.tgz")
    assert "prof/6" in inside or "a/b/c/deep.json" in inside
