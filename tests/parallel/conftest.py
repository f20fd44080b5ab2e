"""tests/parallel: single-device tests run here; ``multidevice/`` needs 8 CPU devices.

JAX fixes its device count when its backend starts, and other tests in this
pytest process start it with one device. So ``multidevice/`` is left out of
collection here and run by ``test_multidevice.py`` in a fresh pytest
subprocess with ``DROPLESS_CPU_DEVICES=8`` (its conftest asks JAX for that
many CPU devices before anything starts the backend).
"""

import os

collect_ignore = [] if os.environ.get("DROPLESS_CPU_DEVICES") else ["multidevice"]
