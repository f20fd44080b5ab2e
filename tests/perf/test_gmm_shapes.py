"""benchmarks/gmm.py's shape sets: the expert GEMMs of the presets."""

from pathlib import Path

from dropless.perf.bench import load_module

REPO = Path(__file__).parents[2]


def test_deepseek_shapes_are_the_ones_measured_before():
    """The set derived from the deepseek3-671b preset is the (M, G, K, N) list every
    earlier gmm record was measured on, typed by hand then, in the same order
    (``--quick`` runs the first 3)."""
    gmm = load_module("gmm", REPO / "benchmarks")
    assert gmm.shape_set("deepseek") == [
        (65536, 32, 7168, 4096),
        (65536, 32, 2048, 7168),
        (65536, 256, 7168, 4096),
        (16384, 8, 7168, 4096),
        (65536, 256, 2048, 7168),
    ]
    assert gmm.shape_set("qwen3-30b") == [(65536, 128, 2048, 1536), (65536, 128, 768, 2048)]
    assert gmm.shape_set("mixtral-8x7b") == [(65536, 8, 4096, 28672), (65536, 8, 14336, 4096)]
