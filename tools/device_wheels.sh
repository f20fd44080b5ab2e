#!/usr/bin/env bash
# Download the wheels the GPU machine's python3 lacks (it has no internet)
# into .whl/, to be carried with a device run and installed there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:src
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl
ver() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# pydantic and tensorboardX for the code; nvidia-ml-py (pynvml) for the
# benchmarks' GPU clock sampling; pytest and hypothesis (and what they need)
# for the GPU tests.
for pkg in pydantic pydantic-core annotated-types typing-inspection tensorboardX nvidia-ml-py \
           pytest pluggy iniconfig packaging hypothesis sortedcontainers; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg==$(ver $pkg)"
done
ls .whl
