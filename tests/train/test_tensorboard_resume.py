"""A resumed run's TensorBoard file purges the steps it writes again and erases no earlier file
(a restart within the same second included)."""

import glob
import os
import struct

from tensorboardX.proto import event_pb2

from dropless.train.metrics import MetricsWriter


def _events(run_dir):
    """Every Event of every event file under run_dir/tensorboard, file by file in write order."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*")),
                       key=lambda p: os.stat(p).st_mtime_ns):
        with open(path, "rb") as f:
            data = f.read()
        i, events = 0, []
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[i:i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
        out.append(events)
    return out


def _scalars(events):
    return {(e.step, v.tag): v.simple_value for e in events for v in e.summary.value}


def test_resume_writes_a_purge_marker_for_the_rewritten_steps(tmp_path):
    run = str(tmp_path)
    w = MetricsWriter(run, enable_tensorboard=True, resume_step=0)
    for step in range(1, 6):
        w.write({"step": step, "loss": 10.0 - step})
    w.close()
    # Killed after step 5, resumed from the checkpoint of step 3: steps 4, 5 run again.
    w = MetricsWriter(run, enable_tensorboard=True, resume_step=3)
    for step in (4, 5):
        w.write({"step": step, "loss": 100.0 + step})
    w.close()
    first, second = _events(run)
    assert _scalars(first)[(5, "learning/loss")] == 5.0
    purges = [e for e in second if e.HasField("session_log")
              and e.session_log.status == event_pb2.SessionLog.START]
    assert [e.step for e in purges] == [4]  # TensorBoard drops earlier events of steps >= 4
    assert _scalars(second) == {(4, "learning/loss"): 104.0, (5, "learning/loss"): 105.0}
    # A fresh run writes no purge marker.
    fresh = str(tmp_path / "fresh")
    MetricsWriter(fresh, enable_tensorboard=True, resume_step=0).close()
    assert not any(e.HasField("session_log") and e.session_log.status == event_pb2.SessionLog.START
                   for e in _events(fresh)[0])
