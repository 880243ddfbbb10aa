# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The torch requirement and where pip looks for it. The default pin is served as a CPU
# build on glassloop's development machines; on a standard Linux box the same pin pulls the
# multi-GB CUDA build from PyPI. For the CPU-only build elsewhere:
#   make demo PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH    ?= torch==2.13.0
PIP_ARGS ?=

.PHONY: demo test lint typecheck unit venv dev clean

# `make demo` installs what glassloop needs to train (torch and the runtime dependencies);
# `make test` adds the dev extra (pytest, ruff, mypy, and the libraries the tests run
# against: transformers, peft, mlflow, wandb, tensorboard, pyarrow, s3fs and moto).
$(BIN)/.runtime: pyproject.toml
	@echo "== [1/3] creating $(VENV) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "== [2/3] installing $(TORCH) (the largest download; pip shows its progress)"
	$(BIN)/pip install --progress-bar on $(PIP_ARGS) $(TORCH)
	@echo "== [3/3] installing glassloop and its runtime dependencies"
	$(BIN)/pip install --progress-bar on -e .
	touch $@

$(BIN)/.dev: $(BIN)/.runtime pyproject.toml
	@echo "== installing the dev extra: test, lint and type-check tools and the libraries the tests use"
	$(BIN)/pip install --progress-bar on -e '.[dev]'
	touch $@

venv: $(BIN)/.runtime

dev: $(BIN)/.dev

demo: venv
	$(BIN)/glassloop train

test: dev lint typecheck unit

lint: dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: dev
	$(BIN)/mypy src/glassloop

# Two workers; a file whose tests share module fixtures (marked xdist_group: one FSDP test
# reads another's run) goes whole to one worker, every other test to whichever is free (whole
# files left one worker idle behind the longest): about 12 minutes on 2 cores.
unit: dev
	$(BIN)/pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
