"""Sensitivity sweeps on Ray: a two-node test cluster gives the serial result exactly, spreads the trials over
both nodes, resumes a stopped sweep without redoing its trials, and the local default starts no service."""
from __future__ import annotations

import json
import sys

import pytest

from workbench.errors import WorkbenchError
from workbench.sensitivity import run_sensitivity
from workbench.sweep_backends import RAY_INSTALL, LocalBackend, RayBackend, backend_for
from workbench.workspace import Workspace

PRECISIONS = ("int8", "int4")


def _ray():
    try:
        from workbench.sweep_backends import import_ray
        return import_ray()
    except WorkbenchError:
        pytest.skip(f"needs ray: {RAY_INSTALL}")


def test_the_local_default_needs_no_ray(lm, monkeypatch):
    assert isinstance(backend_for(None), LocalBackend)
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray would now fail
    report = run_sensitivity(lm, tokens=64, precisions=("int4",), progress=False, backend=LocalBackend())
    assert report.trials_run == len(lm.layers)


def test_ray_missing_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(WorkbenchError, match="pip install ray==2.60.0"):
        RayBackend("auto").run([1], lambda s, t: t, lambda t, r: None, setup=lambda p: None)


def test_an_empty_address_is_refused():
    with pytest.raises(WorkbenchError, match="--ray auto"):
        RayBackend("")


@pytest.fixture(scope="module")
def two_nodes():
    ray = _ray()
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield ray, cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.slow
def test_two_nodes_give_the_serial_result_on_both_nodes(lm, two_nodes, tmp_path):
    ray, _cluster = two_nodes
    import os
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"  # set before ray loaded
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    backend = RayBackend("joined", workers=2, worker_cpus=0.5)  # the connection the fixture made is used
    spread = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, backend=backend)
    assert [x.damage for x in spread.layers] == [x.damage for x in serial.layers]
    assert spread.reference_perplexity == serial.reference_perplexity
    assert len(set(backend.nodes.values())) == 2, backend.nodes  # trials ran on both nodes


@pytest.mark.slow
def test_a_stopped_ray_sweep_resumes_without_redoing_trials(lm, two_nodes, tmp_path):
    ws = Workspace(tmp_path / "ws")
    seen = []

    def stop_after_three(name, precision, result):
        seen.append((name, precision))
        if len(seen) == 3:
            raise KeyboardInterrupt

    backend = RayBackend("joined", workers=2, worker_cpus=0.5)
    with pytest.raises(KeyboardInterrupt):
        run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws, backend=backend,
                        on_trial=stop_after_three)
    progress = list((tmp_path / "ws").rglob("progress.json"))
    assert len(progress) == 1 and len(json.loads(progress[0].read_text())["trials"]) == 3
    total = len(lm.layers) * len(PRECISIONS)
    again = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws,
                            backend=RayBackend("joined", workers=2, worker_cpus=0.5))
    assert again.trials_run == total - 3
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    assert [x.damage for x in again.layers] == [x.damage for x in serial.layers]
