"""benchmarks/tgmm_once.py: the bf16 wgrad launches it gives Nsight Compute run.

``--smoke`` runs its tiny shape in Pallas GPU interpret mode (about 8 s on two
cores): the script builds the layout's group sizes through ``gmm.py`` and calls
``mosaic.tgmm``; a bad layout is refused with argparse's exit code 2.
"""

from pathlib import Path

import pytest

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]
once = load_module("tgmm_once", REPO / "benchmarks")


def test_smoke_runs_the_kernel(capsys):
    once.main(["--smoke", "--calls", "1"])
    out = capsys.readouterr().out
    assert "dirichlet0.3" in out and "dw (2, 256, 256) bfloat16" in out


def test_unknown_layout_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        once.main(["--layout", "zipf"])
    assert e.value.code == 2
    assert "--layout 'zipf'" in capsys.readouterr().err


def test_smoke_leaves_no_interpret_mode_behind():
    """The smoke run's interpret mode is scoped: later tests in the same worker trace the
    real kernels (a process-wide switch once broke two remat tests that ran after it)."""
    from dropless.ops.gmm.quantized import _interpreting

    once.main(["--smoke", "--calls", "1"])
    assert not _interpreting()
