"""Sensitivity sweeps on Ray: a two-node test cluster gives the serial result exactly, spreads the trials over
both nodes, resumes a stopped sweep without redoing its trials, and the local default starts no service."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import stop_sweep_after
from workbench.errors import WorkbenchError
from workbench.precision.sensitivity import run_sensitivity
from workbench.model.sweep_backends import RAY_INSTALL, LocalBackend, RayBackend, backend_for
from workbench.files.workspace import Workspace

PRECISIONS = ("int8", "int4")


def _ray():
    try:
        from workbench.model.sweep_backends import import_ray
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
    backend = RayBackend("joined", workers=2, worker_cpus=0.5)
    with pytest.raises(KeyboardInterrupt):
        run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws, backend=backend,
                        on_trial=stop_sweep_after(3))
    progress = list((tmp_path / "ws").rglob("progress.json"))
    assert len(progress) == 1 and len(json.loads(progress[0].read_text())["trials"]) == 3
    total = len(lm.layers) * len(PRECISIONS)
    again = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, workspace=ws,
                            backend=RayBackend("joined", workers=2, worker_cpus=0.5))
    assert again.trials_run == total - 3
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    assert [x.damage for x in again.layers] == [x.damage for x in serial.layers]


@pytest.mark.slow
def test_a_node_lost_mid_sweep_still_gives_the_serial_result(lm, two_nodes):
    ray, cluster = two_nodes
    serial = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False)
    worker_node = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    removed = []

    def lose_a_node(name, precision, result):
        if not removed:
            cluster.remove_node(worker_node)
            removed.append(True)

    backend = RayBackend("joined", workers=2, worker_cpus=0.5)
    spread = run_sensitivity(lm, tokens=64, precisions=PRECISIONS, progress=False, backend=backend,
                             on_trial=lose_a_node)
    assert removed
    assert [x.damage for x in spread.layers] == [x.damage for x in serial.layers]
    cluster.add_node(num_cpus=1)  # as the fixture made it, for any test after this one


@pytest.mark.slow
def test_cli_ray_auto_matches_the_serial_run_and_sends_nothing_outside(tiny_model_dir, tmp_path):
    import os
    import shutil
    import subprocess
    from test_offline import outside_calls
    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # the workbench must set them itself
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, "-m", "workbench", "sensitivity", str(tiny_model_dir), "--tokens", "64",
            "--precisions", "int4", "--json"]
    serial = subprocess.run([*args, "--workspace", str(tmp_path / "a")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert serial.returncode == 0, serial.stderr[-2000:]
    trace = tmp_path / "trace.txt"
    spread = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect,sendto,sendmsg,sendmmsg", "-o", str(trace),
                             *args, "--workspace", str(tmp_path / "b"), "--ray", "auto", "--workers", "2"],
                            capture_output=True, text=True, env=env, timeout=500)
    assert spread.returncode == 0, spread.stderr[-2000:]
    a, b = json.loads(serial.stdout), json.loads(spread.stdout)
    assert b["layers"] == a["layers"] and b["trials_run"] == a["trials_run"] == len(a["layers"])
    text = trace.read_text()
    # Ray 2.60's API server asks the cloud-metadata addresses which cloud it is on even with usage statistics off;
    # the workbench points its HTTP at a refused loopback port (sweep_backends.loopback_http_proxy)
    assert "169.254.169.254" not in text and "/metadata/" not in text
    outside = [line for line in outside_calls(text) if '"::ffff:127.' not in line]  # v4-mapped loopback (gRPC)
    assert outside == []  # no route probe to 8.8.8.8, no metadata probe, no DNS, nothing sent to another host


@pytest.mark.slow
def test_cli_plan_on_ray_auto_gives_the_serial_plan(tiny_model_dir, tmp_path):
    """`workbench plan --ray auto`: the sweep and the refinement's rounds on Ray choose and measure the same plan."""
    import os
    import subprocess
    _ray()
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    outs = []
    for name, extra in (("serial", ["--workers", "1"]), ("ray", ["--ray", "auto", "--workers", "2"])):
        run = subprocess.run([sys.executable, "-m", "workbench", "plan", str(tiny_model_dir), "--bits-per-weight", "5",
                              "--score", "kl", "--tokens", "64", "--refine", "3",
                              "--out", str(tmp_path / f"{name}.json"), "--workspace", str(tmp_path / name), "--json",
                              *extra], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(json.loads(run.stdout))
    a, b = outs
    assert b["assignments"] == a["assignments"] and b["refinement"]["moves"] == a["refinement"]["moves"]
    assert b["kl_divergence"] == a["kl_divergence"] and b["refinement"]["trials"] == a["refinement"]["trials"] > 0


@pytest.mark.slow
def test_the_payload_tensors_are_mapped_from_the_store_not_copied(two_nodes):
    """A worker's model is the object store's one copy: two reads of the payload share memory, keep dtypes, shapes
    and tied weights; the tensor serializer is registered only while the payload is put."""
    import torch

    from workbench.model.sweep_backends import _tensors_shared_in_the_store
    ray, _cluster = two_nodes
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    halves = torch.randn(3, 5).to(torch.bfloat16)
    with _tensors_shared_in_the_store(ray):
        ref = ray.put((torch.nn.ModuleDict({"emb": emb, "head": head}), halves))
    (m1, h1), (m2, _) = ray.get(ref), ray.get(ref)
    assert m1["emb"].weight is m1["head"].weight
    assert m1["emb"].weight.data_ptr() == m2["emb"].weight.data_ptr()  # one mapping of the store, no copy
    assert torch.equal(m1["emb"].weight, emb.weight) and h1.dtype == torch.bfloat16 and torch.equal(h1, halves)
    plain = ray.put(halves)
    assert ray.get(plain).data_ptr() != ray.get(plain).data_ptr()  # outside the block: Ray's own (copying) pickle


@pytest.mark.slow
def test_a_model_larger_than_the_store_is_said(two_nodes, caplog):
    """The test cluster's nodes keep 150 MB object stores: a larger model would be copied into every worker."""
    import logging

    import torch

    from workbench.model.sweep_backends import _warn_if_the_store_is_small, model_bytes
    ray, _cluster = two_nodes
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    assert model_bytes((torch.nn.ModuleDict({"emb": emb, "head": head}), "tokens")) == 1000 * 64 * 4  # tied once
    with caplog.at_level(logging.WARNING, logger="workbench"):
        _warn_if_the_store_is_small(ray, torch.nn.Linear(64, 1000))
        assert not caplog.records
        _warn_if_the_store_is_small(ray, torch.nn.Linear(8192, 5120, bias=False))  # 168 MB
    assert "--object-store-memory" in caplog.text and "0.17 GB" in caplog.text
