# Two entry points, both self-contained on a fresh machine (python3 with venv, make):
#   make demo   set up .venv, then a bootstrap peer + 3 volunteers on 127.0.0.1 train a small model
#   make test   set up .venv, then run the test suite (what .ci/run runs)
#   make deps   print the import picture by layer (p2pdiloco/layers.py) and check it has no cycle
# Every install goes through constraints.txt: torch is pinned (an unpinned torch pulls GBs of CUDA
# packages) and numpy < 2.4 (newer numpy silently breaks hivemind 1.1.12's 8-bit codecs).

PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed-$(shell cat setup.cfg constraints.txt pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test test-slow test-gpu bench deps lint clean

setup: $(STAMP)

$(STAMP): setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test]' --config-settings editable_mode=compat
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/p2pdiloco demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

test-gpu: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m gpu tests/test_gpu.py

deps:
	$(PYTHON) -m p2pdiloco.layers

bench: $(STAMP)
	$(VENV)/bin/python -m p2pdiloco.bench.run --matrix full

clean:
	rm -rf $(VENV) runs bench_results .pytest_cache
