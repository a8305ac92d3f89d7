# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO ?= demo-data
# The researchers' stack (constraints-pinned.txt), a second venv the whole suite runs on too. torch 2.1.2 from PyPI
# is its CUDA build (about 2.5 GB of nvidia-* wheels), which runs on a CPU as well.
PINNED_PYTHON ?= python3.11
PINNED ?= .venv-pinned
WHEELS ?= wheels

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench,their]"
	$(PY) -m pip install -q --no-deps "litdata==0.2.76"
	touch $@

# their pins first, as their environment has them; then this package, which must not move any of them
$(PINNED)/.installed: pyproject.toml constraints-pinned.txt
	$(PINNED_PYTHON) -m venv $(PINNED)
	$(PINNED)/bin/python -m pip install -q -r constraints-pinned.txt
	$(PINNED)/bin/python -m pip install -q -c constraints-pinned.txt -e ".[dev,their]"
	touch $@

install: $(VENV)/.installed

install-pinned: $(PINNED)/.installed

## Offline install beside the researchers' pins: this package's wheel and every dependency their pins lack, in
## $(WHEELS)/ (`pip install --no-index --find-links wheels lifeseq-shards` installs it with no network).
## Run it with the Python of that environment (PINNED_PYTHON, 3.11 here); it installs nothing.
wheels:
	$(PINNED_PYTHON) -m tools.offline_wheels $(WHEELS) --pins constraints-pinned.txt

## The main job on the embedded default: synthesise, convert, verify, plan for 2 GPUs x 2 workers (batches of persons,
## then of a token budget beside them), read batches.
demo: $(VENV)/.installed
	$(VENV)/bin/shardify synth $(DEMO)/raw --people 5000 --seed 0 --overwrite
	$(VENV)/bin/shardify convert $(DEMO)/raw/sequences.parquet --vocab $(DEMO)/raw/vocab.csv -o $(DEMO)/shards \
		--nodes 1 --gpus 2 --workers 2 --val-fraction 0.05 --overwrite
	$(VENV)/bin/shardify verify $(DEMO)/shards
	$(VENV)/bin/shardify inspect $(DEMO)/shards
	$(VENV)/bin/shardify plan $(DEMO)/shards --nodes 1 --gpus 2 --workers 2 --batch-size 64
	$(VENV)/bin/shardify plan $(DEMO)/shards --nodes 1 --gpus 2 --workers 2 --tokens-per-batch 16384
	$(PY) -m tools.demo_batches $(DEMO)/shards

## Before every commit: ruff, then the fast tests on the newest stack (those marked neither slow nor bench). Here and
## in `test`, --durations=25 ends each log with its 25 slowest tests and fixtures, the ones to cut next.
check: $(VENV)/.installed
	$(VENV)/bin/ruff check lifeseq_shards tools tests
	$(PY) -m pytest -q --durations=25 -m "not slow and not bench"

## The whole test suite on both stacks (installs first): ruff, then the newest stack's suite and the researchers'
## pins' side by side, each in TEST_WORKERS pytest-xdist processes that take whole test files, so that a module's
## fixtures run once (tests/xdist_groups.py: the files reading one of the session's shared launches, such as the 2x2
## torchrun run, go to one process together). Many tests wait on processes they start, and a second process a stack
## fills the core a wait leaves idle (the times: README, CHANGELOG). Each stack's output is printed whole once both
## are done, and either failing fails. First, as best effort, a single-node SLURM from
## Debian's packages (root and apt-get: about 14 s to install and start, instant once up), so that the guide's array
## and merge scripts are submitted to a real SLURM; without it that one test skips, and `make test` goes on.
TESTLOGS ?= .test-logs
TEST_WORKERS ?= 2
SUITE := -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=25
test: $(VENV)/.installed $(PINNED)/.installed
	$(VENV)/bin/ruff check lifeseq_shards tools tests
	@timeout 300 tools/slurm_single_node.sh || echo "make test: no SLURM (exit $$?): the real-SLURM test will skip"
	@mkdir -p $(TESTLOGS)
	@{ $(PY) -m pytest $(SUITE) > $(TESTLOGS)/newest.log 2>&1; \
	   echo $$? > $(TESTLOGS)/newest.rc; } & \
	 { $(PINNED)/bin/python -m pytest $(SUITE) > $(TESTLOGS)/pinned.log 2>&1; \
	   echo $$? > $(TESTLOGS)/pinned.rc; }; wait; \
	 echo "== the newest stack"; cat $(TESTLOGS)/newest.log; \
	 echo "== the researchers' pinned stack"; cat $(TESTLOGS)/pinned.log; \
	 test "$$(cat $(TESTLOGS)/newest.rc)" = 0 && test "$$(cat $(TESTLOGS)/pinned.rc)" = 0

.PHONY: install install-pinned wheels demo check test
