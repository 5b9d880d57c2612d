# whisper-cli developer targets. Everything installs from scratch on a fresh
# machine that has only Python 3.11, pip and gcc.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of this pinned torch lies on the build machine's disk; any
# other version or range would make pip download multi-GB CUDA builds.
TORCH_PIN := torch==2.13.0
MODELS := models
CACHE := .cache

.PHONY: install models demo test test-fast lint format eval bench clean

# openai-whisper is the test-only word-timing reference (tests/reference_whisper.py). Its
# own requirements would pull triton (hundreds of MB, unused on CPU): it is installed bare,
# with what its import needs. pip then reports triton as missing; nothing here uses it.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[test,ray]" "$(TORCH_PIN)"
	$(PIP) install -q --no-deps "openai-whisper==20250625"
	$(PIP) install -q numba tiktoken more-itertools tqdm "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

models: $(MODELS)/tiny.en/model.safetensors $(MODELS)/base/model.safetensors

$(MODELS)/tiny.en/model.safetensors $(MODELS)/base/model.safetensors: | install
	$(PY) scripts/fetch_models.py --models-dir $(MODELS) --cache-dir $(CACHE)

$(CACHE)/demo/sample.wav: | install
	$(PY) scripts/fetch_demo.py --out-dir $(CACHE)/demo

demo: models $(CACHE)/demo/sample.wav
	$(VENV)/bin/whisper-cli transcribe $(CACHE)/demo/sample.wav --model $(MODELS)/tiny.en

test: models
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: models
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

eval: models
	$(VENV)/bin/whisper-cli eval ../shared/audio/manifest.json --model $(MODELS)/tiny.en --dtype all
	$(VENV)/bin/whisper-cli eval ../shared/audio/manifest.json --model $(MODELS)/base --dtype all

bench: models
	$(VENV)/bin/whisper-cli bench --model $(MODELS)/base --dtype all

clean:
	rm -rf $(VENV) $(MODELS) $(CACHE)
