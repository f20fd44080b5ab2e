"""Where ptxas puts the FP8 kernels' scale reads, read off their SASS for an H200 on any host.

Marker ``gpu_compile`` (``make test-gpu-compile``): each kernel is compiled for an H200 in a
fresh process (``python -m dropless.perf.gpu_compile``, with ``MOSAIC_GPU_DUMP_PTX=1``
writing its PTX), assembled by the local ptxas and disassembled by cuobjdump
(``tools/sass_schedule.sh``, which lists each wgmma, wgmma wait, fence and barrier wait).
With ``scale_reads="before"`` (the default) the scale reads' fence, a ``MEMBAR``, stands
between the step's slot wait and its first ``QGMMA``: the warpgroup waits for its scale loads
before its tensor work. With ``"under"`` the first ``QGMMA`` follows the slot wait directly and
the fence comes after it, before the wgmma's wait (``mosaic_fp8.SCALE_READS``). Skipped
without jax's CUDA plugin, ptxas or cuobjdump (``$CUOBJDUMP``, ``PATH``, or the wheels
``tools/sass_schedule.sh`` unpacks into ``~/.cache/dropless-cuda``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.perf import gpu_compile

REPO = Path(__file__).resolve().parents[2]


def _cuobjdump():
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    cached = sorted((Path.home() / ".cache" / "dropless-cuda").rglob("cuobjdump"))
    return str(cached[0]) if cached else None


pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not gpu_compile.plugin_installed(),
                       reason="needs jax's CUDA plugin (make gpu-compile-venv)"),
    pytest.mark.skipif(shutil.which("ptxas") is None or _cuobjdump() is None,
                       reason="needs ptxas and cuobjdump (tools/sass_schedule.sh)"),
]

# Small shapes, the default schedule's tiles: the forward at 192 columns per warpgroup,
# the wgrad's plain step at 160.
PROGRAMS = {
    "fwd": """
import functools, jax, jax.numpy as jnp
from dropless.ops.gmm import mosaic_fp8
S, F8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
m, k, n, g = 1024, 256, 512, 2
FN = functools.partial(mosaic_fp8.gmm_fp8_blockwise, block_o=192, scale_reads="{reads}")
ARGS = (S((m, k), F8), S((k // 128, m), jnp.float32), S((g, n, k), F8),
        S((g, k // 128, n // 128), jnp.float32), S((g,), jnp.int32))
""",
    "wgrad": """
import functools, jax, jax.numpy as jnp
from dropless.ops.gmm import mosaic_fp8_tgmm
S, F8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
m, k, n, g = 1024, 256, 512, 2
FN = functools.partial(mosaic_fp8_tgmm.tgmm_fp8_blockwise, overlap=False, block_n=160,
                       scale_reads="{reads}")
ARGS = (S((k, m), F8), S((m // 128, k), jnp.float32), S((n, m), F8),
        S((m // 128, n), jnp.float32), S((g,), jnp.int32))
""",
}


def _schedule(tmp_path, kernel, reads):
    """``tools/sass_schedule.sh``'s lines for ``kernel`` compiled with ``scale_reads=reads``."""
    prog, dump = tmp_path / f"{kernel}_{reads}.py", tmp_path / f"{kernel}_{reads}"
    prog.write_text(PROGRAMS[kernel].format(reads=reads))
    dump.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_PTX": "1",
           "MOSAIC_GPU_DUMP_TO": str(dump)}
    subprocess.run([sys.executable, "-m", "dropless.perf.gpu_compile", str(prog)], cwd=REPO,
                   env=env, check=True, capture_output=True, timeout=300)
    (ptx,) = dump.glob("*.ptx")
    out = subprocess.run([str(REPO / "tools" / "sass_schedule.sh"), str(ptx)], check=True,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUOBJDUMP": _cuobjdump()})
    return [line.split("| ", 1)[1] for line in out.stdout.splitlines() if "| " in line]


def _around_first_wgmma(lines):
    """(the instructions between the last slot wait and the first QGMMA, those from the
    first QGMMA to the first wgmma wait after it)."""
    first = next(i for i, line in enumerate(lines) if line.startswith("QGMMA"))
    wait = max(i for i in range(first) if "SYNCS.PHASECHK" in lines[i])
    depbar = next(i for i in range(first, len(lines)) if "WARPGROUP.DEPBAR" in lines[i])
    return lines[wait + 1:first], lines[first:depbar]


@pytest.mark.parametrize("kernel", sorted(PROGRAMS))
def test_scale_reads_under_move_the_fence_behind_the_first_wgmma(tmp_path, kernel):
    before, during = _around_first_wgmma(_schedule(tmp_path, kernel, "before"))
    assert any(line.startswith("MEMBAR") for line in before), before
    assert not any(line.startswith("MEMBAR") for line in during), during
    before, during = _around_first_wgmma(_schedule(tmp_path, kernel, "under"))
    assert not any(line.startswith("MEMBAR") for line in before), before
    assert any(line.startswith("MEMBAR") for line in during), during
