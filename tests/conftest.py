"""Shared fixtures: tiny models built from a config (never downloaded), and a scratch workspace."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from workbench.assets import DEMO_MODEL_DIR  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_tiny_model(path: Path, arch: str = "qwen3", *, hidden: int = 64, intermediate: int = 128, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, seed: int = 0, tie: bool = True, **overrides) -> Path:
    """Write a randomly initialised tiny causal LM with the demo tokenizer to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "llama": (LlamaConfig, LlamaForCausalLM)}
    cfg_cls, model_cls = classes[arch]
    kw = dict(vocab_size=4096, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
              tie_word_embeddings=tie, eos_token_id=0, pad_token_id=0)
    if arch == "qwen3":
        kw["head_dim"] = hidden // heads
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL_DIR / f, path / f)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 (hidden 64, 2 layers) saved as a local HF directory."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3")


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    """The tiny model loaded once per test module."""
    from workbench.model.load import load_model
    return load_model(tiny_model_dir)


@pytest.fixture
def make_tiny_model(tmp_path):
    """Factory: ``make_tiny_model(arch="llama", hidden=96, ...)`` -> directory."""
    counter = iter(range(1000))

    def make(arch: str = "qwen3", **kw) -> Path:
        return build_tiny_model(tmp_path / f"{arch}-{next(counter)}", arch, **kw)
    return make


@pytest.fixture(scope="session")
def _default_workspace_root(tmp_path_factory):
    return tmp_path_factory.mktemp("default-workspace")


@pytest.fixture(autouse=True)
def default_workspace(_default_workspace_root, monkeypatch):
    """``Workspace()`` (what commands use unless told) writes under the test session's scratch folder, never the
    checkout's ./workspace; shared by the session so statistics computed once are reused."""
    import workbench.files.workspace
    monkeypatch.setattr(workbench.files.workspace, "DEFAULT_WORKSPACE", _default_workspace_root)
    return _default_workspace_root


@pytest.fixture
def workspace(tmp_path):
    from workbench.files.workspace import Workspace
    return Workspace(tmp_path / "ws")


class Interrupted(Exception):
    """Raised by ``interrupt_at``'s callback: a run killed part-way, for resume tests."""


def stop_sweep_after(n: int):
    """An ``on_trial(name, precision, result)`` callback that stops a sweep (KeyboardInterrupt) at its n-th trial."""
    seen = []

    def on_trial(name, precision, result):
        seen.append((name, precision))
        if len(seen) == n:
            raise KeyboardInterrupt
    return on_trial


def interrupt_at(step: int):
    """An ``on_step(step, loss)`` callback that interrupts a training run when it reaches ``step``."""
    def on_step(at, _loss):
        if at == step:
            raise Interrupted
    return on_step


def stop_process(proc, timeout: float = 30) -> None:
    """Terminate a server a test started, and kill it if it does not exit in ``timeout`` seconds."""
    import subprocess
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def loaded_app(root: Path, model: str, eval_tokens: int):
    """The app on ``model`` with small sample counts, its run and workspace under ``root``, loaded."""
    from workbench.files.workspace import Workspace
    from workbench.ui.app import WorkbenchApp
    app = WorkbenchApp(model, samples=4, seq_len=32, eval_tokens=eval_tokens, out_dir=root / "run",
                       workspace=Workspace(root / "ws"))
    assert app.load() is not None, app.error
    return app


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The app's flow on the demo model, once per test session: uniform INT8/INT4 evaluated in Precisions, RTN INT4
    quantized, converted to ort-int4, profiled, projected, downloaded. Returns ``(workspace root, app)``."""
    from workbench.ui.app import WorkbenchApp
    from workbench.files.workspace import Workspace
    root = tmp_path_factory.mktemp("demo-run") / "workspace"
    app = WorkbenchApp("demo", samples=4, seq_len=64, sweep_tokens=128, eval_tokens=1024, workspace=Workspace(root),
                       out_dir=root / "app" / "run-demo")
    assert app.load() is not None, app.error
    assert len(app.override_panel.evaluate_uniform()) == 2
    assert app.quantize_panel.run() is not None, app.quantize_panel.error
    assert app.convert_panel.run("ort-int4") is not None, app.convert_panel.error
    app.profile_panel.prompt_lengths.value, app.profile_panel.repeats.value = "8", 1
    assert app.profile_panel.run() is not None, app.profile_panel.error
    assert app.project_panel.run() is not None, app.project_panel.error
    assert app.download() is not None, app.error
    return root, app


CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")


def linear_inputs(model, feeds) -> dict[str, torch.Tensor]:
    """Every linear layer's whole input over ``feeds`` (the model's keyword inputs, one dict a batch), gathered with
    plain forward hooks: the reference a calibration's statistics are checked against."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(
        args[0].detach().reshape(-1, args[0].shape[-1]).double().clone()))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            for feed in feeds:
                model(**feed, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(xs) for n, xs in seen.items()}


def browser_skips(playwright_found: bool) -> list:
    """The skip marks of a browser test: each missing piece named, with how to install it."""
    return [
        pytest.mark.skipif(not playwright_found, reason="the browser test needs the playwright package: "
                           ".venv/bin/pip install -c constraints.txt -r requirements.txt"),
        pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"the browser test needs Chromium at {CHROMIUM}: "
                           "apt-get install -y chromium (as root; .ci/run does this), or set WORKBENCH_CHROMIUM"),
    ]



@contextlib.contextmanager
def workbench_notes():
    """The messages the ``workbench`` logger gives at INFO (as the CLI sets it) while the block runs.

    A handler on that logger itself, not caplog's on the root: the CLI stops propagation once it has run.
    """
    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logger = logging.getLogger("workbench")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield notes
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_measured(cmd: list[str], *, timeout: float = 600) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``cmd`` with the package on its path; return it with that child's own peak resident memory in bytes.

    ``os.wait4`` gives the child's own usage: ``RUSAGE_CHILDREN`` would be the largest of every child the
    test session has waited for.
    """
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.1)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    return done, usage.ru_maxrss * 1024  # kilobytes on Linux
