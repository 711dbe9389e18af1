# make app    set up .venv (once) and start JupyterLab on the notebooks, bound to 127.0.0.1
# make test   set up .venv, .venv-rknn and .venv-edgellm (once) and run the whole test suite, notebooks included
# make rknn-env  Rockchip's rknn-toolkit2 in its own venv (.venv-rknn), for the rknn target
# make edgellm-env  NVIDIA's TensorRT Edge-LLM exporter in its own venv (.venv-edgellm), for the tensorrt-edgellm target
# make voila  set up .venv (once) and serve the click-through app (notebooks/app.ipynb) on 127.0.0.1: open the
#             URL it prints (it carries the token)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PORT    ?= 8888
VOILA_PORT ?= 8866
# jupyter refuses root unless told; the extension manager would otherwise query PyPI
ROOTFLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
STAMP   := $(VENV)/.installed

.PHONY: install app voila test bench demo-model demo-vl-model clean rknn-env edgellm-env

install: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -r requirements.txt
	$(BIN)/pip install -q --no-deps autoawq==0.2.9
	$(BIN)/pip install -q --no-deps onnxruntime-genai==0.18.0
# onnxruntime-qnn 2.7.0: Qualcomm's QNN EP as an onnxruntime >= 1.24.2 plugin with the HTP emulator (x86-64);
# --no-deps keeps the project's onnxruntime (the htp target, `convert --target qnn --soc`)
	$(BIN)/pip install -q --no-deps onnxruntime-qnn==2.7.0
	$(BIN)/pip install -q --no-deps executorch==1.5.1 torchao==0.18.0 ruamel.yaml==0.19.1 tabulate==0.10.0
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

app: install
	$(BIN)/jupyter lab notebooks/ --ServerApp.ip=127.0.0.1 --port=$(PORT) --no-browser \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate --LabApp.extension_manager=readonly \
		--LabApp.news_url=None $(ROOTFLAG)

voila: install
	$(BIN)/python -m workbench.ui.serve --port $(VOILA_PORT)

test: install rknn-env edgellm-env
	$(BIN)/python -m pytest tests/ --nbmake notebooks/ -q

bench: install
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

demo-model: install
	$(BIN)/python scripts/build_demo_model.py

demo-vl-model: install
	$(BIN)/python scripts/build_demo_vl_model.py

# make rknn-env  Rockchip's rknn-toolkit2 in its own venv (its pins conflict with .venv); the rknn
# target runs it as a subprocess with the project's torch stub (workbench/targets/rknn_stub) on PYTHONPATH
RKNN_VENV  := .venv-rknn
RKNN_STAMP := $(RKNN_VENV)/.installed

rknn-env: $(RKNN_STAMP)

$(RKNN_STAMP):
	test -x $(RKNN_VENV)/bin/python || $(PY) -m venv $(RKNN_VENV)
	$(RKNN_VENV)/bin/pip install -q --no-deps rknn-toolkit2==2.5.0 numpy==1.26.4 onnx==1.18.0 \
		protobuf==4.25.4 'onnxruntime<1.23' psutil ruamel.yaml ruamel.yaml.clib scipy tqdm \
		opencv-python-headless fast-histogram typing_extensions coloredlogs humanfriendly flatbuffers packaging sympy mpmath
	PYTHONPATH=workbench/targets/rknn_stub $(RKNN_VENV)/bin/python -c "import rknn.api"
	touch $(RKNN_STAMP)

# make edgellm-env  TensorRT Edge-LLM's exporter (tensorrt-edgellm 0.11.0, Python 3.10-3.12) in its own venv
# (its export extra pins transformers 5.14.1 and onnx 1.19.0); the tensorrt-edgellm target runs its export
# as a subprocess. torch is pinned first so nothing pulls a CUDA build; the package goes in --no-deps: its
# base dependency cuda-python is only for the Jetson runtime, and its [tools] extra (torchvision) breaks it.
EDGELLM_VENV  := .venv-edgellm
EDGELLM_STAMP := $(EDGELLM_VENV)/.installed

edgellm-env: $(EDGELLM_STAMP)

$(EDGELLM_STAMP):
	test -x $(EDGELLM_VENV)/bin/python || $(PY) -m venv $(EDGELLM_VENV)
	$(EDGELLM_VENV)/bin/pip install -q --upgrade pip
	$(EDGELLM_VENV)/bin/pip install -q torch==2.13.0
	$(EDGELLM_VENV)/bin/pip install -q torch==2.13.0 transformers==5.14.1 'huggingface-hub>=1.5.0,<2.0' \
		onnx==1.19.0 onnxscript==0.7.1 safetensors==0.8.0 numpy==2.2.6 onnx-graphsurgeon==0.6.1
	$(EDGELLM_VENV)/bin/pip install -q --no-deps tensorrt-edgellm==0.11.0
	$(EDGELLM_VENV)/bin/python -c "import torch, tensorrt_edgellm; tensorrt_edgellm.export_onnx; \
		assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(EDGELLM_STAMP)

clean:
	rm -rf $(VENV) $(RKNN_VENV) $(EDGELLM_VENV) workspace .pytest_cache
