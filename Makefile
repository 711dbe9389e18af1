# make app    set up .venv (once) and start JupyterLab on the notebooks, bound to 127.0.0.1
# make test   set up .venv (once) and run the whole test suite, notebooks included
# make voila  set up .venv (once) and serve the click-through app (notebooks/app.ipynb) on 127.0.0.1
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PORT    ?= 8888
VOILA_PORT ?= 8866
# jupyter refuses root unless told; the extension manager would otherwise query PyPI
ROOTFLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
STAMP   := $(VENV)/.installed

.PHONY: install app voila test bench demo-model clean

install: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -r requirements.txt
	$(BIN)/pip install -q --no-deps autoawq==0.2.9
	$(BIN)/pip install -q --no-deps onnxruntime-genai==0.18.0
# onnxruntime-qnn 2.7.0: Qualcomm's QNN EP as an onnxruntime >= 1.24.2 plugin with the HTP emulator (x86-64);
# --no-deps keeps the project's onnxruntime (the htp target, `convert --target qnn --soc`)
	$(BIN)/pip install -q --no-deps onnxruntime-qnn==2.7.0
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

app: install
	$(BIN)/jupyter lab notebooks/ --ServerApp.ip=127.0.0.1 --port=$(PORT) --no-browser \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate --LabApp.extension_manager=readonly $(ROOTFLAG)

voila: install
	$(BIN)/python -m workbench.ui.serve --port $(VOILA_PORT)

test: install
	$(BIN)/python -m pytest tests/ --nbmake notebooks/ -q

bench: install
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

demo-model: install
	$(BIN)/python scripts/build_demo_model.py

clean:
	rm -rf $(VENV) workspace .pytest_cache
