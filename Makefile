# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, pinned: the newest supported release, with the Triton its wheel pins (torch 2.14 has no
# CPU build, so this is its CUDA 13 wheel, which runs CPU-only without a GPU). A python that already has torch (a GPU
# image) keeps its own.
TORCH_SPEC ?= torch==2.14.1

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,cute]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m latent_moe_fusion demo

test: install
	$(PY) -m ruff check latent_moe_fusion tests bench
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: install
	$(PY) -m ruff check latent_moe_fusion tests bench

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
