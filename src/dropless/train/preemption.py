"""SIGTERM during ``train``'s steps: finish the step, save it, end with exit code 143.

Cluster schedulers (SLURM, Kubernetes) send SIGTERM and kill the process
after a grace period. ``watch(...)`` is held around the training steps only;
the loop asks ``reached(step)`` after dispatching each step, and when it is
true finishes that step, writes its metrics row, saves it (forced), waits
until the save is written and sealed, and raises ``Preempted(step)``. Which
mechanism answers ``reached`` depends on the number of processes:

* **One process: a plain signal flag.** A Python SIGTERM handler sets it (the
  handler that was there before is put back when the steps end). Python runs
  handlers only in the main thread between bytecodes, so a signal that comes
  while the main thread is inside XLA (the first step's compile can take
  minutes, longer than a grace period) would wait for it. A watcher thread
  therefore reads ``signal.set_wakeup_fd``, where Python's C-level handler
  writes each signal at once, and ends the process itself, with one line and
  code 143, in two cases: a SIGTERM before the first step has finished
  (nothing to save; the compile is abandoned) and a second SIGTERM (the save
  in flight is cut off; Orbax writes under a temporary name and dropless
  treats a step without its manifest as incomplete, so nothing under a step
  name is half written, and the resume removes the leftovers).

* **Several processes (``jax.distributed``): JAX's preemption service.**
  Every process must save the same step, or the save's collectives would
  wait forever. ``jax.distributed.initialize`` starts the service (on by
  default: ``jax_enable_preemption_service``), which installs its own SIGTERM
  handler in C++ (XLA's TSL ``SigtermNotifier``); a notice in any process
  starts a protocol that takes every process's latest counter and sets the
  sync point to the largest plus one, and
  ``multihost_utils.reached_preemption_sync_point(n)`` is then true in every
  process at the same ``n`` (Orbax's ``CheckpointManager.reached_preemption``
  is this call; dropless keeps its own save schedule). No Python handler is
  installed on this path: it would replace JAX's. The counter passed is the
  global step, because Orbax's ``CheckpointManager.save`` and its finalize
  thread pass the global step to the same call (a counter of our own would
  mix with theirs). JAX's counter starts at 0, so ``watch`` sets it to the
  run's starting step in every process before the steps: a notice during the
  compile then makes the first step the sync point.
  What this path cannot do: TSL polls its flag once a second and the protocol
  has a barrier, so the run stops a few steps after the signal; a SIGTERM
  during the compile waits for it; a second SIGTERM is swallowed by JAX's
  handler. A notice before the steps (during set-up or the restore of a
  resumed run) sets the sync point from JAX's counter of 0, before any step
  this run makes: the run is not stopped by it and the scheduler's kill ends
  it, losing the steps made since the notice (the checkpoints are intact).
  With the service turned off a SIGTERM keeps its default action (the
  process dies; the checkpoints saved before are intact) and a line says so
  when the steps start.
"""

import contextlib
import os
import signal
import socket
import sys
import threading
from typing import Callable, Iterator

EXIT_CODE = 128 + signal.SIGTERM  # 143, as shells report a process ended by SIGTERM
_STOP_WATCHER = b"\0"  # no signal has number 0


class Preempted(Exception):
    """The steps stopped at a preemption after ``step`` (saved, if checkpointing is on)."""

    def __init__(self, step: int):
        super().__init__(f"preempted after step {step}")
        self.step = step


class Watch:
    """Whether to stop after a step; see the module docstring.

    Args:
      multi_process: use JAX's preemption sync point (every process agrees on
        the step) instead of a signal flag.
      at_once_line: ``(stopping_at) -> str``: the line printed when the process
        ends at once (one-process path): ``stopping_at`` is None for a SIGTERM
        before the first step finished, else the step being finished and saved
        when a second SIGTERM came (0: a second SIGTERM before any step was
        chosen).
      exit: ends the process (``os._exit``; tests replace it).
    """

    def __init__(self, *, multi_process: bool, at_once_line: Callable[[int | None], str],
                 exit: Callable[[int], None] = os._exit):
        self.multi_process = multi_process
        self._at_once_line = at_once_line
        self._exit = exit
        self._lock = threading.Lock()
        self._requested = False  # the one-process flag, set by the Python handler
        self._first_step_done = False
        self._stopping_at: int | None = None  # the step reached() said to stop after
        self._signals = 0  # SIGTERMs the watcher thread has seen

    def reached(self, step: int) -> bool:
        """Whether to stop after global step ``step`` (call once per step, in every process)."""
        if self.multi_process:
            from jax.experimental import multihost_utils

            stop = multihost_utils.reached_preemption_sync_point(step)
        else:
            stop = self._requested
        if stop:
            with self._lock:
                self._stopping_at = step
        return stop

    def first_step_done(self) -> None:
        """From now on a first SIGTERM stops after the step in progress instead of at once."""
        with self._lock:
            self._first_step_done = True

    def _on_sigterm(self, signum, frame) -> None:  # the main thread, between bytecodes
        self._requested = True

    def _saw_sigterm(self) -> None:  # the watcher thread, at once
        with self._lock:
            self._signals += 1
            if self._first_step_done and self._signals == 1:
                return  # the flag stops the loop after this step
            stopping_at = None if not self._first_step_done else (self._stopping_at or 0)
        try:
            line = self._at_once_line(stopping_at)
        except Exception as e:  # noqa: BLE001 - the process ends either way; say what is known
            line = f"preempted (SIGTERM); ended at once ({type(e).__name__} describing the checkpoints)"
        sys.stdout.flush()
        print(f"dropless: {line}", file=sys.stderr, flush=True)
        self._exit(EXIT_CODE)

    def _watch(self, sock: socket.socket) -> None:
        while True:
            data = sock.recv(64)
            if not data or _STOP_WATCHER in data:
                return
            for _ in range(data.count(bytes([signal.SIGTERM]))):
                self._saw_sigterm()


@contextlib.contextmanager
def watch(*, start: int, at_once_line: Callable[[int | None], str], say: Callable[[str], None],
          exit: Callable[[int], None] = os._exit) -> Iterator[Watch | None]:
    """Handle SIGTERM for the duration of the ``with`` (the training steps); yields a ``Watch``,
    or None where SIGTERM is left as it is (said through ``say``).

    Args:
      start: the step the run starts from (steps done before this invocation).
      at_once_line, exit: as ``Watch``.
      say: ``(line)``: prints a warning.
    """
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        try:  # every process's counter at ``start`` from here on (see the module docstring)
            multihost_utils.reached_preemption_sync_point(start)
        except RuntimeError:  # raised when the service is off
            say("SIGTERM is not handled: jax_enable_preemption_service is off in this multi-process "
                "run, so a SIGTERM ends the process at once (checkpoints already saved are kept)")
            yield None
            return
        yield Watch(multi_process=True, at_once_line=at_once_line, exit=exit)
        return
    if threading.current_thread() is not threading.main_thread():
        say("SIGTERM is not handled: training runs outside the main thread, where Python "
            "cannot install a signal handler")
        yield None
        return
    w = Watch(multi_process=False, at_once_line=at_once_line, exit=exit)
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd requires it
    thread = threading.Thread(target=w._watch, args=(reader,), name="sigterm-watch", daemon=True)
    thread.start()
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = signal.signal(signal.SIGTERM, w._on_sigterm)
    try:
        yield w
    finally:
        # None: a handler installed outside Python, which Python cannot put back.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        signal.set_wakeup_fd(previous_fd)
        writer.send(_STOP_WATCHER)
        thread.join()
        reader.close()
        writer.close()
