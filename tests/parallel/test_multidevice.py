"""Run ``tests/parallel/multidevice`` in a fresh pytest process with 8 CPU devices.

This process has already started JAX with one device, and JAX cannot grow
it; the subprocess sets ``DROPLESS_CPU_DEVICES=8`` before JAX starts. Its
output is shown when it fails.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_multidevice_suite():
    env = {**os.environ, "DROPLESS_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the subprocess's conftest picks its own
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "multidevice")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, f"multidevice tests failed:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail
