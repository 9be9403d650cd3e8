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
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

.venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsift demo --out runs/demo

# the suite on two pytest-xdist workers (one thread each; the tests that read the shared reproduction report on one
# of them), listing its longest tests at the end. pip installs without byte-compiling (half its time: most of what
# it would compile is never imported) and the tests write the bytecode of what they import, once: where
# PYTHONDONTWRITEBYTECODE is set, every process the tests start would compile torch and gradsift again
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n 2 --dist loadgroup --durations=25

wheel: $(STAMP)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) runs build dist src/*.egg-info
