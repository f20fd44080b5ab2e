# Two commands do all set-up on a fresh machine:
#   make train   bootstrap .venv (Python >= 3.12), install, run the main job
#   make test    bootstrap .venv, install, run the CPU test suite
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: train test venv clean wheels

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

train: $(STAMP)
	$(PY) -m dropless train $(ARGS)

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(PYTEST_ARGS)

# Wheels the GPU machine lacks (it has no internet); carried with device runs.
wheels:
	./tools/device_wheels.sh

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
