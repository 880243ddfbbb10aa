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

.PHONY: demo test lint typecheck unit venv clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(PIP_ARGS) $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/glassloop train

test: venv lint typecheck unit

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: venv
	$(BIN)/mypy src/glassloop

# Two workers, each taking whole files (a file's tests share module fixtures, and one FSDP
# test reads another's run): about 9.5 minutes on 2 cores instead of 14.
unit: venv
	$(BIN)/pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
