"""Activation statistics: correctness against a direct computation, model untouched, save/load, caching."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import linear_inputs

import workbench.model.calibrate as calibrate_mod
from workbench.model.calibrate import HIST_EDGES, CalibrationStats, LayerStats, calibrate, run_calibration
from workbench.evaluation.data import CalibrationSet, load_calibration_set
from workbench.errors import WorkspaceError
from workbench.model.load import load_model
from workbench.files.workspace import model_fingerprint

TEXT = ("Quantization maps floating point weights to a few integer levels; calibration shows which input "
        "channels carry the large activations that decide the scales. ") * 40


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def calib_set(lm, calib_file):
    return load_calibration_set(calib_file, tokenizer=lm.tokenizer, samples=6, seq_len=64, min_tokens=64)


def test_statistics_match_a_direct_computation(lm, calib_set):
    stats = run_calibration(lm.model, calib_set, progress=False, batch_size=4, sample_budget=1 << 22)
    ref = linear_inputs(lm.model, ({"input_ids": b} for b in calib_set.batches(4)))
    linear_names = [n for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert list(stats.layers) == linear_names  # every linear, lm_head included, in module order
    for name, x in ref.items():
        s = stats.layers[name]
        a = x.abs()
        assert s.tokens == x.shape[0] == calib_set.tokens
        torch.testing.assert_close(s.abs_max, a.amax(0).float())
        torch.testing.assert_close(s.mean_abs, a.mean(0).float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.rms, x.pow(2).mean(0).sqrt().float(), rtol=1e-4, atol=1e-6)
        flat = x.flatten()
        mu, sd = flat.mean().item(), flat.std(unbiased=False).item()
        kurt = (((flat - mu) / sd) ** 4).mean().item() - 3
        assert s.mean == pytest.approx(mu, rel=1e-4, abs=1e-6)
        assert s.std == pytest.approx(sd, rel=1e-4)
        assert s.kurtosis == pytest.approx(kurt, rel=1e-3, abs=1e-3)
        # percentiles, histogram and near-zero come from a random subsample: close, not exact
        with np.errstate(divide="ignore"):
            logs = np.clip(np.log10(a.flatten().numpy()), HIST_EDGES[0], HIST_EDGES[-1])
        shares = np.histogram(logs, bins=np.array(HIST_EDGES))[0] / flat.numel()
        got = s.hist_counts.numpy() / s.hist_counts.sum().item()
        assert np.abs(got - shares).max() < 0.01
        for key, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            assert s.percentiles[key] == pytest.approx(torch.quantile(a.flatten().float(), q).item(), rel=0.05)
        near = (a < a.max() / 254).double().mean().item()
        assert s.near_zero_fraction == pytest.approx(near, abs=0.01)
        med = a.amax(0).median().item()
        assert s.outlier_channels == torch.nonzero(a.amax(0) > 6 * med).flatten().tolist()
    # q/k/v read the same tensor: identical statistics
    q, k = stats.layers["model.layers.0.self_attn.q_proj"], stats.layers["model.layers.0.self_attn.k_proj"]
    assert torch.equal(q.abs_max, k.abs_max) and q.kurtosis == k.kurtosis


def test_statistics_do_not_depend_on_batching(lm, calib_set):
    a = run_calibration(lm.model, calib_set, progress=False, batch_size=1)
    b = run_calibration(lm.model, calib_set, progress=False, batch_size=6)
    for name in a.layers:
        torch.testing.assert_close(a.layers[name].abs_max, b.layers[name].abs_max)
        torch.testing.assert_close(a.layers[name].mean_abs, b.layers[name].mean_abs, rtol=1e-5, atol=1e-7)
        assert a.layers[name].kurtosis == pytest.approx(b.layers[name].kurtosis, rel=1e-4, abs=1e-5)
        assert a.layers[name].std == pytest.approx(b.layers[name].std, rel=1e-5)


def test_model_is_unchanged(lm, calib_set):
    model = lm.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = calib_set.samples[0][None]
    with torch.no_grad():
        logits_before = model(input_ids=x).logits.clone()
    model.train()
    try:
        run_calibration(model, calib_set, progress=False)
        assert model.training  # mode restored
    finally:
        model.eval()
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, logits_before, rtol=0, atol=0)


def test_hooks_removed_when_forward_fails(lm, calib_set):
    bad = CalibrationSet([torch.full((8,), 10 ** 6, dtype=torch.long)], calib_set.report, 8)  # id beyond the vocab
    with pytest.raises(IndexError):
        run_calibration(lm.model, bad, progress=False)
    assert all(not m._forward_pre_hooks for m in lm.model.modules())


def test_outlier_channels_rule():
    abs_max = torch.ones(16)
    abs_max[3] = 10.0  # 10x the median: an outlier
    abs_max[7] = 5.0  # 5x: within the 6x rule
    s = LayerStats("x", 16, 1, abs_max, abs_max, abs_max, torch.zeros(len(HIST_EDGES) - 1, dtype=torch.long),
                   0.0, 1.0, 0.0, {}, 0.0)
    assert s.outlier_channels == [3] and s.outlier_ratio == 1 / 16 and s.max_to_median == 10.0
    s.outlier_factor = 4.0
    assert s.outlier_channels == [3, 7]


def test_save_load_round_trip(lm, calib_set, tmp_path):
    stats = run_calibration(lm.model, calib_set, progress=False)
    stats.save(tmp_path / "s")
    back = CalibrationStats.load(tmp_path / "s")
    assert list(back.layers) == list(stats.layers)
    for name, s in stats.layers.items():
        b = back.layers[name]
        for f in ("abs_max", "mean_abs", "rms", "hist_counts"):
            assert torch.equal(getattr(s, f), getattr(b, f))
        assert b.summary() == s.summary()
    assert back.meta == stats.meta
    assert not list((tmp_path / "s").glob(".*.tmp"))  # atomic writes leave no temporaries


def test_load_errors(tmp_path, lm, calib_set):
    with pytest.raises(WorkspaceError, match="stats.json' are missing; run calibration again"):
        CalibrationStats.load(tmp_path / "none")
    stats = run_calibration(lm.model, calib_set, progress=False)
    stats.save(tmp_path / "s")
    (tmp_path / "s" / "stats.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(WorkspaceError, match="are corrupt"):
        CalibrationStats.load(tmp_path / "s")


def test_calibrate_caches_in_the_workspace(lm, calib_file, workspace, monkeypatch):
    cs, stats = calibrate(lm, calib_file, samples=6, seq_len=64, workspace=workspace, progress=False)
    assert stats.artifact is not None and (stats.artifact.path / "stats.safetensors").is_file()
    assert (stats.artifact.path / "coverage.json").is_file()
    assert stats.artifact.manifest["inputs"]["calibration"] == cs.fingerprint
    assert stats.meta["samples"] == len(cs) == 6

    def fail(*a, **k):
        raise AssertionError("recomputed although cached")
    monkeypatch.setattr(calibrate_mod, "run_calibration", fail)
    cs2, again = calibrate(lm, calib_file, samples=6, seq_len=64, workspace=workspace, progress=False)
    assert again.artifact.key == stats.artifact.key
    assert torch.equal(again.layers["lm_head"].abs_max, stats.layers["lm_head"].abs_max)
    monkeypatch.undo()
    _, other = calibrate(lm, calib_file, samples=4, seq_len=64, workspace=workspace, progress=False)
    assert other.artifact.key != stats.artifact.key
    assert len(workspace.list("calibrate")) == 2


def test_changed_weights_change_the_key(tiny_model_dir, calib_file, workspace):
    lm2 = load_model(tiny_model_dir)
    fp = model_fingerprint(lm2.model)
    _, a = calibrate(lm2, calib_file, samples=2, seq_len=64, workspace=workspace, progress=False)
    with torch.no_grad():
        lm2.model.model.layers[0].mlp.down_proj.weight.mul_(2)
    assert model_fingerprint(lm2.model) != fp
    _, b = calibrate(lm2, calib_file, samples=2, seq_len=64, workspace=workspace, progress=False)
    assert a.artifact.key != b.artifact.key


def test_seq_len_beyond_the_model(lm, calib_file, workspace):
    with pytest.raises(ValueError, match=r"seq_len 1024 exceeds the model's max_position_embeddings \(256\)"):
        calibrate(lm, calib_file, seq_len=1024, workspace=workspace)


def _same_stats(a: CalibrationStats, b: CalibrationStats) -> None:
    import dataclasses
    assert list(a.layers) == list(b.layers)
    for name in a.layers:
        da, db = dataclasses.asdict(a.layers[name]), dataclasses.asdict(b.layers[name])
        for key, value in da.items():
            same = torch.equal(value, db[key]) if isinstance(value, torch.Tensor) else value == db[key]
            assert same, (name, key)


def test_a_killed_calibration_resumes_from_its_checkpoint(lm, calib_file, tmp_path, monkeypatch, caplog):
    from workbench.files.workspace import Workspace
    monkeypatch.setattr(calibrate_mod, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every batch
    kw = dict(samples=6, seq_len=64, batch_size=2, progress=False)
    _, whole = calibrate(lm, calib_file, workspace=Workspace(tmp_path / "a"), **kw)
    calls = []

    def killed_at_the_third_batch(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    handle = lm.model.model.layers[0].register_forward_pre_hook(killed_at_the_third_batch)
    ws = Workspace(tmp_path / "b")
    try:
        with pytest.raises(KeyboardInterrupt):
            calibrate(lm, calib_file, workspace=ws, **kw)
    finally:
        handle.remove()
    assert ws.list("calibrate") == [] and len(list((tmp_path / "b" / "calibrate").glob(".partial-*/checkpoint.pt"))) == 1
    with caplog.at_level("INFO", logger="workbench"):
        _, resumed = calibrate(lm, calib_file, workspace=ws, **kw)
    assert "calibration resumed after batch 2 of 3" in caplog.text and resumed.meta["resumed_after_batch"] == 2
    assert whole.meta["resumed_after_batch"] == 0
    _same_stats(whole, resumed)
    assert "checkpoint.pt" not in resumed.artifact.manifest["files"] and not list(tmp_path.rglob("checkpoint.pt"))


def test_a_checkpoint_for_other_batches_is_not_used(lm, calib_set, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint")
    whole = run_calibration(lm.model, calib_set, progress=False, batch_size=2)
    again = run_calibration(lm.model, calib_set, progress=False, batch_size=2, checkpoint=path)
    assert again.meta["resumed_after_batch"] == 0
    _same_stats(whole, again)
