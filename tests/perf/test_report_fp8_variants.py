"""``report_fp8``'s names for what training runs are the probe's variants with training's
kernel arguments: ``DEFAULT_VARIANTS`` is the ``default`` kernel schedule, ``NARROW_VARIANTS``
the ``narrow`` one (``quantized.KERNEL_SCHEDULES``), each product's keyword arguments filled
with the kernel's own defaults on both sides. A changed default schedule without the report's
names changed with it fails here instead of quoting another kernel's numbers as the default's."""

import inspect
from pathlib import Path

import pytest

from dropless.ops.gmm import mosaic_fp8, mosaic_fp8_tgmm, quantized
from dropless.perf import report_fp8
from dropless.perf.bench import load_module

REPO = Path(__file__).resolve().parents[2]


def _full(kernel, kwargs):
    """The kernel's keyword defaults overridden by ``kwargs``."""
    params = inspect.signature(kernel).parameters
    unknown = set(kwargs) - set(params)
    assert not unknown, f"{kernel.__name__} takes no {sorted(unknown)}"
    return {name: kwargs.get(name, p.default) for name, p in params.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("schedule,names", [("default", report_fp8.DEFAULT_VARIANTS),
                                            ("narrow", report_fp8.NARROW_VARIANTS)])
def test_report_names_are_the_schedules_kernels(schedule, names):
    probe = load_module("fp8_kernel_probe", REPO / "benchmarks")
    for product, variant in names.items():
        kernel, table, side = ((mosaic_fp8_tgmm.tgmm_fp8_blockwise, probe.WGRAD_VARIANTS, "tgmm")
                               if product == "wgrad" else
                               (mosaic_fp8.gmm_fp8_blockwise, probe.VARIANTS, "gmm"))
        trained = quantized._schedule(schedule, side)
        assert _full(kernel, table[variant]) == _full(kernel, trained), (product, variant)
