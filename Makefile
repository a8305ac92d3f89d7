# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO ?= demo-data

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	$(PY) -m pip install -q --no-deps "litdata==0.2.76"
	touch $@

install: $(VENV)/.installed

## The main job on the embedded default: synthesise, convert, verify, plan for 2 GPUs x 2 workers, read batches.
demo: $(VENV)/.installed
	$(VENV)/bin/shardify synth $(DEMO)/raw --people 5000 --seed 0 --overwrite
	$(VENV)/bin/shardify convert $(DEMO)/raw/sequences.parquet --vocab $(DEMO)/raw/vocab.csv -o $(DEMO)/shards \
		--nodes 1 --gpus 2 --workers 2 --val-fraction 0.05 --overwrite
	$(VENV)/bin/shardify verify $(DEMO)/shards
	$(VENV)/bin/shardify inspect $(DEMO)/shards
	$(VENV)/bin/shardify plan $(DEMO)/shards --nodes 1 --gpus 2 --workers 2 --batch-size 64
	$(PY) -m tools.demo_batches $(DEMO)/shards

## The whole test suite (installs first).
test: $(VENV)/.installed
	$(VENV)/bin/ruff check lifeseq_shards tools tests
	$(PY) -m pytest -q

.PHONY: install demo test
