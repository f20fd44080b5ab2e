# Two commands do all set-up on a fresh machine:
#   make train   bootstrap .venv (Python >= 3.12), install, run the main job; with
#                an NVIDIA GPU (nvidia-smi found) also jax's CUDA build (extra "cuda")
#   make test    bootstrap .venv, install, run the CPU test suite (never CUDA)
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
CUDA_STAMP = $(VENV)/.installed-cuda
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: train test venv clean wheels gpu-compile-venv test-gpu-compile

venv: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  py=$$(./tools/find_python.sh); \
	  echo "Creating $(VENV) with $$py"; \
	  "$$py" -m venv "$(VENV)"; \
	fi; \
	"$(PY)" -m pip install -q --upgrade pip; \
	"$(PY)" -m pip install -q -e ".[test]"; \
	touch "$(STAMP)"

# The CUDA build only where a GPU is: on a machine without one, train runs on CPU.
$(CUDA_STAMP): $(STAMP)
	@set -e; \
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing jax's CUDA build (extra 'cuda' of pyproject.toml)"; \
	  "$(PY)" -m pip install -q -e ".[test,cuda]"; \
	  touch "$(CUDA_STAMP)"; \
	fi

train: $(CUDA_STAMP)
	$(PY) -m dropless train $(ARGS)

# Two pytest workers (pytest-xdist, work stealing): the suite is mostly XLA
# compiles of small programs, one core each; on two cores this took the suite
# from 7.8 to 5.4 minutes.
PYTEST_WORKERS ?= 2

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# A second venv with jax's CUDA plugin (no NVIDIA libraries): XLA:GPU's optimized HLO
# for an H200 on a host without a GPU (dropless.perf.gpu_compile, tests marked
# gpu_compile). Kept apart from .venv, whose jax must stay CPU-only here.
GC_VENV = .venv-gpucompile
gpu-compile-venv: $(GC_VENV)/.installed

$(GC_VENV)/.installed: pyproject.toml
	@set -e; \
	if [ ! -x "$(GC_VENV)/bin/python" ]; then "$$(./tools/find_python.sh)" -m venv "$(GC_VENV)"; fi; \
	"$(GC_VENV)/bin/python" -m pip install -q --upgrade pip; \
	"$(GC_VENV)/bin/python" -m pip install -q -e ".[test,gpu-compile]"; \
	touch "$@"

test-gpu-compile: gpu-compile-venv
	JAX_PLATFORMS=cpu $(GC_VENV)/bin/python -m pytest -q -m gpu_compile $(PYTEST_ARGS)

# Wheels the GPU machine lacks (it has no internet); carried with device runs.
wheels:
	./tools/device_wheels.sh

clean:
	rm -rf $(VENV) $(GC_VENV) build src/*.egg-info .pytest_cache
