"""``perf.measure.cupti_kernel_ms``: CUPTI's iterations in chunks whose outputs fit.

CUPTI itself needs a GPU, so the profiler is replaced by a stand-in that
records how many iterations each call asked for and returns one time per
iteration; the chunking is what is under test.
"""

import jax
import jax.numpy as jnp
import pytest

from dropless.perf import measure


@pytest.fixture
def fake_profiler(monkeypatch):
    from jax.experimental.mosaic.gpu import profiler

    calls = []

    def fake_measure(fn, iterations=1):
        def run(*args):
            calls.append(iterations)
            out = fn(*args)
            times = [float(len(calls))] * iterations
            return out, times[0] if iterations == 1 else times
        return run

    monkeypatch.setattr(profiler, "measure", fake_measure)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    return calls


def test_small_outputs_run_in_one_back_to_back_chunk(fake_profiler):
    x = jnp.ones((4, 4), jnp.float32)  # 64 output bytes
    times = measure.cupti_kernel_ms(lambda a: a * 2, x, iters=10)
    assert fake_profiler == [10] and len(times) == 10


def test_large_outputs_are_chunked_under_the_live_bytes_bound(fake_profiler):
    """At G=256 a [256, 7168, 2048] bf16 gradient is 7.5 GB, so under the default
    16 GiB two calls' outputs fit; the same ratio at toy size: 16 bytes per call
    under a 40-byte bound gives ten iterations as five chunks of two."""
    assert measure.CUPTI_LIVE_BYTES // (256 * 7168 * 2048 * 2) == 2
    small = jnp.ones((8,), jnp.bfloat16)
    times = measure.cupti_kernel_ms(lambda a: a + 1, small, iters=10, max_live_bytes=40)
    assert fake_profiler == [2, 2, 2, 2, 2] and len(times) == 10


def test_an_output_over_the_bound_runs_one_call_at_a_time(fake_profiler):
    small = jnp.ones((8,), jnp.bfloat16)
    times = measure.cupti_kernel_ms(lambda a: a + 1, small, iters=3, max_live_bytes=4)
    assert fake_profiler == [1, 1, 1] and times == [1.0, 2.0, 3.0]


def test_iters_must_be_positive():
    with pytest.raises(ValueError, match="iters"):
        measure.cupti_kernel_ms(lambda a: a, jnp.ones(2), iters=0)


def test_off_the_gpu_it_refuses_before_touching_the_profiler(monkeypatch):
    """On a CPU host the profiler would run the function and try CUPTI, after which a
    Pallas interpret-mode kernel never finished (``gmm.py --smoke`` hung); callers
    catch the error and time by wall clock instead."""
    from jax.experimental.mosaic.gpu import profiler

    def must_not_run(*a, **k):
        raise AssertionError("profiler called off the GPU")

    monkeypatch.setattr(profiler, "measure", must_not_run)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(RuntimeError, match="backend is cpu"):
        measure.cupti_kernel_ms(lambda a: a, jnp.ones(2), iters=2)
