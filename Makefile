# Two commands do all set-up on a fresh machine:
#   make demo   -- compare every compressor on digits-cnn (the main job)
#   make test   -- the test suite
# `make .venv` does the set-up alone. torch is installed first and pinned, so pip
# takes the local CPU build instead of pulling a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test wheel .venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

.venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsift demo --out runs/demo

# the 25 longest tests are listed at the end
test: $(STAMP)
	$(BIN)/python -m pytest --durations=25

wheel: $(STAMP)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) runs build dist src/*.egg-info
