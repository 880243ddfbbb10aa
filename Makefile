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

.PHONY: demo test lint typecheck unit venv dev lock docs clean

# `make demo` installs what glassloop needs to train (torch and the runtime dependencies);
# `make test` adds the dev extra (pytest, ruff, mypy, and the libraries the tests run
# against: transformers, peft, mlflow, wandb, tensorboard, pyarrow, s3fs and moto).
# Both install with `-c $(LOCK)`: the versions every package had when the tests last passed,
# so a fresh clone resolves nothing and a new release cannot break it (`make lock` moves them).
LOCK := requirements.lock

$(BIN)/.runtime: pyproject.toml $(LOCK)
	@echo "== [1/3] creating $(VENV) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "== [2/3] installing $(TORCH) (the largest download; pip shows its progress)"
	$(BIN)/pip install --progress-bar on -c $(LOCK) $(PIP_ARGS) $(TORCH)
	@echo "== [3/3] installing glassloop and its runtime dependencies"
	$(BIN)/pip install --progress-bar on -c $(LOCK) -e .
	touch $@

$(BIN)/.dev: $(BIN)/.runtime pyproject.toml $(LOCK)
	@echo "== installing the dev extra: test, lint and type-check tools and the libraries the tests use"
	$(BIN)/pip install --progress-bar on -c $(LOCK) -e '.[dev]'
	touch $@

venv: $(BIN)/.runtime

dev: $(BIN)/.dev

demo: venv
	$(BIN)/glassloop train

test: dev lint typecheck unit

lint: dev
	$(BIN)/ruff check src tests benchmarks docs/*.py
	$(BIN)/ruff format --check src tests benchmarks docs/*.py

typecheck: dev
	$(BIN)/mypy src/glassloop

# The documentation site into site/, offline, from docs/ and mkdocs.yml; strict: a broken link
# or anchor, or an API reference that does not resolve, fails it. It regenerates nothing:
# docs/cli.md and docs/config.md are committed (python docs/gen_reference.py rewrites them;
# tests/docs/test_reference.py fails while they differ from the code).
docs: dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Two workers; a file whose tests share module fixtures (marked xdist_group: one FSDP test
# reads another's run) goes whole to one worker, every other test to whichever is free (whole
# files left one worker idle behind the longest): pytest about 7.5 minutes on 2 cores.
# Re-resolves pyproject.toml from the index (the only target that does) and rewrites the lock;
# tests/test_lock.py fails until the lock matches pyproject.toml again. Needs only a pip.
lock:
	test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --dry-run --ignore-installed --report $(VENV)/lock-report.json \
	  $(PIP_ARGS) $(TORCH) -e '.[dev]'
	$(BIN)/python tests/test_lock.py $(VENV)/lock-report.json

unit: dev
	$(BIN)/pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
