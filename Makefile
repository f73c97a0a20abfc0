# The two quick-start commands live here so that a fresh clone needs nothing else.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# setuptools notes on every editable install that a folder named like the package (bnrecal/, the
# public face) may shadow it: that layout is deliberate (docs/architecture.md), so the note is muted.
PIP := $(BIN)/python -W "ignore:Editable installation" -m pip
BASE := $(VENV)/.installed-base
DEMO := $(VENV)/.installed-demo
TESTING := $(VENV)/.installed-test
# The browser tests (tests/api/test_web_page.py) drive Debian's Chromium through Playwright;
# `playwright install` is not used (it downloads from a CDN).
CHROMIUM := /usr/bin/chromium
# The ledger tests and the replicated-service tests start a throwaway cluster of Debian's PostgreSQL.
POSTGRES := $(firstword $(wildcard /usr/lib/postgresql/*/bin/initdb) /usr/lib/postgresql/15/bin/initdb)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The MLflow tests log to a real tracking server (`mlflow server`, SQLite backend). The full `mlflow`
# package pins pyarrow below the project's, so the server lives in a venv of its own; the
# project's venv has MLflow's client (the `mlflow` extra), as users have.
MLFLOW_VENV := .venv-mlflow
MLFLOW_SERVER := $(MLFLOW_VENV)/.installed
# The MDS tests read shards written by MosaicML Streaming's own MDSWriter, run in a process of
# its own with this folder on its path. Streaming pins numpy below 2.2 and transformers below 5
# (the project has both above), so it is not installed in the project's venv: its package and
# the compression modules it imports go here alone (--no-deps), over the project's numpy, torch
# and PIL, which its writer runs on as they are.
STREAMING_WRITER := .streaming-writer
STREAMING := $(STREAMING_WRITER)/.installed

.PHONY: install browser postgres mlflow-server serve demo test check durations bench clean

# What serving needs (`make serve`: the service, and OpenVINO to check its exports), then the
# demo's scikit-learn (`make demo`), then the test extra (`make test`: nncf, Playwright,
# transformers, timm, moto, psycopg, schemathesis).
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: this build lies on the machine's disk (no multi-GB download).
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PIP) install --quiet -e '.[openvino]'
	touch $@

$(DEMO): $(BASE)
	$(PIP) install --quiet -e '.[openvino,demo]'
	touch $@

$(TESTING): $(DEMO)
	$(PIP) install --quiet -e '.[openvino,demo,test]'
	touch $@

install: $(BASE)

$(CHROMIUM):
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium

browser: $(CHROMIUM)

$(POSTGRES):
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql

postgres: $(POSTGRES)

$(MLFLOW_SERVER):
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install --quiet mlflow==3.17.2
	touch $@

mlflow-server: $(MLFLOW_SERVER)

$(STREAMING): $(BASE)
	$(PIP) install --quiet --no-deps --target $(STREAMING_WRITER) mosaicml-streaming==0.13.0 \
		brotli python-snappy cramjam zstd xxhash catalogue
	touch $@

serve: $(BASE)
	$(BIN)/bnrecal serve --data-dir .bnrecal

# The stale model is trained once (about a minute) and reused: `make demo RETRAIN=1` trains it again.
demo: $(DEMO)
	$(BIN)/python -m bnrecal.service.demo demo $(if $(RETRAIN),--retrain)
	$(BIN)/bnrecal calibrate --arch torchvision:resnet18 --model-kwargs '{"num_classes": 10}' \
		--checkpoint demo/resnet18-stale.pt --data demo/calib.npy --eval-data demo/eval.npz \
		--workers 2 --batch-size 64 --out demo/resnet18-recalibrated.pt --onnx demo/resnet18.onnx \
		--onnx-int8 demo/resnet18-int8.onnx --report demo/report.json --report-html demo/report.html

test: $(TESTING) $(CHROMIUM) $(POSTGRES) $(MLFLOW_SERVER) $(STREAMING)
	$(BIN)/python -m pytest

# The quick tier for the edit-and-test loop: every test module's cheapest test, chosen by the
# kept durations of a whole run (docs/development.md). `make test` stays the whole suite.
check: $(TESTING) $(CHROMIUM) $(POSTGRES) $(MLFLOW_SERVER) $(STREAMING)
	$(BIN)/python -m pytest --quick

# The whole suite, then its durations kept as the quick tier's measure (tests/durations.json).
durations: test
	cp test-artifacts/durations.json tests/durations.json

bench: $(TESTING)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) $(STREAMING_WRITER) demo .bnrecal
