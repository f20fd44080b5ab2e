"""Host-side overflow policy: when it checks, what it says, error vs warn."""

import pytest

from dropless.parallel.overflow import (EPOverflowError, OverflowMonitor, sufficient_factor,
                                        sufficient_rounds)

NAMES = ["decoder layer 1", "decoder layer 2", "mtp 0"]


def test_error_names_layer_tokens_and_factor():
    mon = OverflowMonitor(every_n_steps=4, policy="error", buffer_factor=1.0, layer_names=NAMES)
    mon.record(1, [0, 0, 0], [0.9, 0.8, 0.5])
    mon.record(2, [0, 12, 0], [0.9, 2.5, 0.5])
    mon.record(3, [0, 3, 0], [0.9, 1.3, 0.5])  # no check before step 4
    with pytest.raises(EPOverflowError) as e:
        mon.record(4, [0, 0, 0], [0.9, 0.9, 0.9])
    msg = str(e.value)
    assert "2 of steps 1-4 (step 2, 3)" in msg
    assert "decoder layer 2: 15 token rows (needs factor 2.5)" in msg
    assert "decoder layer 1" not in msg and "mtp 0" not in msg
    assert "ragged_buffer_factor=1 is too small: 2.5 would have sufficed" in msg
    assert "ep_overflow_rounds=2 would have delivered" in msg  # 3 windows of 1x for 2.5x


def test_warn_continues_and_resets():
    seen = []
    mon = OverflowMonitor(every_n_steps=2, policy="warn", buffer_factor=1.5, layer_names=NAMES,
                          warn=seen.append)
    mon.record(1, [0, 0, 7], [1.0, 1.0, 3.001])
    mon.record(2, [0, 0, 0], [1.0, 1.0, 1.0])
    assert len(seen) == 1 and "mtp 0: 7 token rows" in seen[0] and "3.01 would" in seen[0]
    mon.record(3, [0, 0, 0], [1.0, 1.0, 1.0])
    mon.record(4, [0, 0, 0], [1.0, 1.0, 1.0])
    assert len(seen) == 1 and mon.total_overflow_steps == 1


def test_final_check_catches_overflow_between_checks():
    mon = OverflowMonitor(every_n_steps=20, policy="error", buffer_factor=2.0, layer_names=NAMES)
    mon.record(1, [1, 0, 0], [2.2, 0, 0])
    with pytest.raises(EPOverflowError, match="decoder layer 1: 1 token rows"):
        mon.check(3)


def test_sufficient_factor_and_bad_args():
    assert sufficient_factor(0.3) == 1.0
    assert sufficient_factor(2.0) == 2.0
    assert sufficient_factor(2.001) == 2.01
    assert [sufficient_rounds(n, 2.0) for n in (2.2, 4.0, 4.01, 9.0)] == [1, 1, 2, 4]
    with pytest.raises(ValueError, match="policy"):
        OverflowMonitor(every_n_steps=1, policy="drop", buffer_factor=1, layer_names=NAMES)
    with pytest.raises(ValueError, match=">= 1"):
        OverflowMonitor(every_n_steps=0, policy="warn", buffer_factor=1, layer_names=NAMES)
