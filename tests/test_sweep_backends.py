"""Local worker processes (ProcessBackend): the sweep and the refinement give the serial result exactly, a
stopped sweep resumes without redoing trials, a worker that dies is reported with what to do, and the CLI's
--workers runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import stop_sweep_after
from workbench.errors import WorkbenchError
from workbench.precision.sensitivity import run_sensitivity
from workbench.model.sweep_backends import LocalBackend, ProcessBackend, RayBackend, backend_for
from workbench.files.workspace import Workspace

PRECISIONS = ("int8", "int4")


def test_backend_for_picks_by_address_and_workers():
    assert isinstance(backend_for(), LocalBackend) and isinstance(backend_for(None, 1), LocalBackend)
    assert isinstance(backend_for(None, 3), ProcessBackend) and backend_for(None, 3).workers == 3
    ray = backend_for("auto", 2)
    assert isinstance(ray, RayBackend) and ray.workers == 2
    with pytest.raises(WorkbenchError, match="at least 1 worker"):
        ProcessBackend(0)


def test_two_processes_give_the_serial_sweep_exactly(lm):
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    backend = ProcessBackend(2)
    spread = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, backend=backend)
    assert [x.damage for x in spread.layers] == [x.damage for x in serial.layers]
    assert spread.reference_perplexity == serial.reference_perplexity
    assert spread.trials_run == serial.trials_run == len(lm.layers) * len(PRECISIONS)
    assert len(backend.peaks) == 2 and os.getpid() not in backend.peaks  # two workers, neither this process
    assert all(0 < backend.private[pid] < backend.peaks[pid] for pid in backend.peaks)  # the model is shared


def test_a_stopped_sweep_on_processes_resumes_without_redoing_trials(lm, tmp_path):
    ws = Workspace(tmp_path / "ws")
    with pytest.raises(KeyboardInterrupt):
        run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws,
                        backend=ProcessBackend(2), on_trial=stop_sweep_after(3))
    progress = list((tmp_path / "ws").rglob("progress.json"))
    assert len(progress) == 1 and len(json.loads(progress[0].read_text())["trials"]) == 3
    again = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws,
                            backend=ProcessBackend(2))
    assert again.trials_run == len(lm.layers) * len(PRECISIONS) - 3
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    assert [x.damage for x in again.layers] == [x.damage for x in serial.layers]


def _dies_on_the_third(state, task):
    if task == 3:
        os._exit(9)  # as the out-of-memory killer would end it
    return task * 10


def test_a_worker_that_dies_is_reported_and_finished_results_are_kept():
    kept = {}
    with pytest.raises(WorkbenchError, match="worker process died.*rerun to resume"):
        ProcessBackend(2).run(range(8), _dies_on_the_third, kept.__setitem__, state=None, setup=lambda p: None)
    assert all(kept[t] == t * 10 for t in kept) and 3 not in kept


def test_refinement_on_processes_equals_the_serial_refinement(lm):
    from workbench.precision.autoplan import plan_for_budget, plan_footprint, refine_plan
    from workbench.quantize.plan import QuantPlan
    from workbench.precision.sensitivity import LayerVariants, PlanEvaluator, evaluation_tokens
    sens = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    budget = int(1.1 * plan_footprint(lm, QuantPlan.uniform("int4", keep_embeddings="int4"))["size_bytes"])
    auto = plan_for_budget(lm, sens, size_bytes=budget)
    ids = evaluation_tokens(lm, None, 64)

    def refined(backend):
        evaluator = PlanEvaluator(lm, ids, variants=LayerVariants(lm, **sens.quantizer_settings))
        return refine_plan(lm, sens, auto, evaluator, trials=6, per_round=3, backend=backend)

    serial, spread = refined(None), refined(ProcessBackend(2))
    assert spread.to_dict() | {"seconds": 0} == serial.to_dict() | {"seconds": 0}
    assert spread.prediction.assignments == serial.prediction.assignments


def test_cli_workers_gives_the_serial_sweep(tiny_model_dir, tmp_path):
    args = [sys.executable, "-m", "workbench", "sensitivity", str(tiny_model_dir), "--tokens", "64",
            "--precisions", "int4", "--score", "kl", "--json"]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outs = []
    for extra in ([], ["--workers", "2"]):
        run = subprocess.run([*args, "--workspace", str(tmp_path / f"ws{len(outs)}"), *extra], capture_output=True,
                             text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(json.loads(run.stdout))
    assert outs[1]["layers"] == outs[0]["layers"] and outs[1]["trials_run"] == outs[0]["trials_run"] > 0
