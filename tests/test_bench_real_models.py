"""bench/real_models.py and scripts/gguf_to_hf.py on a tiny model written here (no package, no download)."""
import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
real = runpy.run_path(str(ROOT / "bench" / "real_models.py"))
sys.path.insert(0, str(ROOT / "scripts"))
import gguf_to_hf  # noqa: E402


def test_reference_rounding_is_the_workbench_full_range_grid_on_the_plans_layers(make_tiny_model):
    pytest.importorskip("gguf")
    from workbench.model.load import load_model
    from workbench.quantize import quantize_model
    lm = load_model(str(make_tiny_model("llama", tie=False)), dtype="float32")
    plan = real["uniform_plan"](4, full_range=True, scale_search=False)
    ref = real["reference_weights"](lm, "Q4_0", plan)
    qm = quantize_model(lm, plan, progress=False)
    modules = dict(lm.model.named_modules())
    for info in lm.layers:
        if plan.precision_for(info.name).is_float:  # the embedding and output layer: float16, as the plan keeps them
            assert torch.equal(ref[info.name], modules[info.name].weight.detach().half().float())
        else:  # llama.cpp's Q4_0 (the gguf package's quantizer) and the workbench's 16-level RTN: the same weights
            assert torch.equal(ref[info.name], qm.weights[info.name].dequantize())


def test_gguf_to_hf_round_trips_a_gguf_and_records_its_source(make_tiny_model, tmp_path):
    pytest.importorskip("gguf")
    from workbench.model.load import load_model
    from workbench.quantize import quantize_model
    from workbench.targets.gguf_file import write_gguf
    lm = load_model(str(make_tiny_model("qwen2")), dtype="float32")
    qm = quantize_model(lm, real["uniform_plan"](8, full_range=True), progress=False)
    path = write_gguf(qm, tmp_path / "g" / "model.gguf")
    rec = gguf_to_hf.convert(path, tmp_path / "hf", "tiny==0")
    assert rec["package"] == "tiny==0" and rec["stored_types"]["Q8_0"] == len(qm.weights)
    assert len(rec["sha256"]) == 64 and (tmp_path / "hf" / "SOURCE.json").is_file()
    back = load_model(str(tmp_path / "hf"), dtype="float32")
    name = next(iter(qm.weights))
    got = dict(back.model.named_modules())[name].weight.detach()
    assert torch.equal(got, qm.weights[name].dequantize())


def test_verdict_judges_against_the_best_llamacpp_file_of_no_smaller_size():
    lrows = [{"type": "Q4_0", "tensor_bytes": 1010, "kl": 0.15, "kl_se": 0.005},
             {"type": "IQ4_NL", "tensor_bytes": 1000, "kl": 0.09, "kl_se": 0.003},
             {"type": "Q4_K_M", "tensor_bytes": 1200, "kl": 0.03, "kl_se": 0.001}]
    v = real["verdict"]
    assert v({"tensor_bytes": 990, "kl": 0.05, "kl_se": 0.002}, lrows)["versus"] == "IQ4_NL"  # both ~1000: the best
    assert v({"tensor_bytes": 990, "kl": 0.05, "kl_se": 0.002}, lrows)["outcome"] == "win"
    assert v({"tensor_bytes": 1005, "kl": 0.14, "kl_se": 0.005}, lrows)["versus"] == "Q4_0"  # IQ4_NL is smaller
    assert v({"tensor_bytes": 1005, "kl": 0.152, "kl_se": 0.005}, lrows)["outcome"] == "tie"
    assert v({"tensor_bytes": 1100, "kl": 0.04, "kl_se": 0.001}, lrows)["outcome"] == "loss"
    assert v({"tensor_bytes": 1300, "kl": 0.01, "kl_se": 0.001}, lrows)["versus"] is None


def test_verdict_pairs_the_tokens_when_both_rows_carry_them():
    import numpy as np
    rng = np.random.default_rng(2)
    theirs = rng.exponential(0.07, 1000)
    ours = theirs * 0.97  # 3% less KL on every token: inside the unpaired errors, plainly ahead when paired
    lrows = [{"type": "Q4_0", "tensor_bytes": 1000, "kl": theirs.mean(), "kl_se": theirs.std() / 31.6,
              "token_kl": list(theirs)}]
    row = {"tensor_bytes": 1000, "kl": ours.mean(), "kl_se": ours.std() / 31.6}
    assert real["verdict"](row, lrows)["outcome"] == "tie" and not real["verdict"](row, lrows)["paired"]
    got = real["verdict"]({**row, "token_kl": list(ours)}, lrows)
    assert got["paired"] and got["outcome"] == "win"
    assert got["minus_versus_se"] < got["minus_versus_se_unpaired"] / 10
    assert got["minus_versus"] == pytest.approx(ours.mean() - theirs.mean())


def test_mirror_and_fill_plans_match_the_bytes_their_gguf_holds(make_tiny_model, tmp_path):
    pytest.importorskip("gguf")
    import gguf
    from workbench.model.load import load_model
    from workbench.quantize import quantize_model
    from workbench.targets.gguf_file import write_gguf
    lm = load_model(str(make_tiny_model("llama", tie=True, hidden=256, intermediate=512)), dtype="float32")
    names = real["layer_gguf_names"](lm)
    types = {g: ("Q8_0" if "token_embd" in g else "Q6_K" if "ffn_down" in g else "Q4_K" if "ffn" in g else "Q5_0")
             for g in names.values()}
    plan = real["mirror_plan"](lm, types)
    tied = next(i for i in lm.layers if i.tied_to)
    assert plan.precision_name_for(tied.name) == plan.precision_name_for(tied.tied_to) == "int8"
    assert plan.precision_name_for("model.layers.0.mlp.up_proj") == "int4-k"
    full = real["tensor_bytes"](lm, real["mirror_plan"](lm, {g: "Q8_0" for g in names.values()}))
    budget = int(0.7 * full)
    small = real["fill_plan"](lm, budget, "int5", "int4", "int8")
    assert budget - 70_000 < real["tensor_bytes"](lm, small) <= budget
    assert small.precision_name_for("model.layers.0.self_attn.v_proj") == "int8"  # raised first
    assert small.precision_name_for("model.layers.0.mlp.up_proj") == "int4-k"  # k-layout where blocks fit
    for p in (plan, small):
        qm = quantize_model(lm, p, progress=False)
        path = write_gguf(qm, tmp_path / f"{p.content_hash()}.gguf")
        got = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
        assert got == real["tensor_bytes"](lm, p)
        assert not qm.unties_embeddings


def test_the_matrices_a_llamacpp_file_keeps_in_the_sources_own_type_are_counted():
    source = {"blk.0.ffn_down.weight": "Q4_K", "blk.0.attn_q.weight": "Q5_0", "blk.0.attn_norm.weight": "F32"}
    same = {"type": "Q4_K_M", "tensor_types": {**source}}
    other = {"type": "Q5_K_M", "tensor_types": {**source, "blk.0.attn_q.weight": "Q5_1"}}
    assert real["own_share"](same, source) == (2, 2) and real["own_share"](other, source) == (1, 2)


def test_auto_plans_stay_within_the_llamacpp_files_bytes_and_spend_them(make_tiny_model, tmp_path):
    """The auto plan from a proxy sweep on calibration tokens: its GGUF's tensors within the budget and near it, a
    k-layout only where the 256-weight blocks fit, the tied output one tensor with the embedding, and a larger
    budget buys less estimated damage."""
    pytest.importorskip("gguf")
    import gguf
    from workbench.precision.autoplan import predict_damage
    from workbench.model.load import load_model
    from workbench.quantize import heldout_ids, quantize_model
    from workbench.targets.gguf_file import write_gguf
    lm = load_model(str(make_tiny_model("llama", tie=True, hidden=96, intermediate=256)), dtype="float32")
    sens = real["auto_sweep"](lm, heldout_ids(lm, max_tokens=256), tmp_path, 256, 128, print)
    names = real["layer_gguf_names"](lm)
    low = real["tensor_bytes"](lm, real["mirror_plan"](lm, {g: "Q4_0" for g in names.values()}))
    high = real["tensor_bytes"](lm, real["mirror_plan"](lm, {g: "Q8_0" for g in names.values()}))
    damages = []
    for budget in (low, (low + high) // 2, high):
        plan = real["auto_plan"](lm, budget, sens)
        got = real["tensor_bytes"](lm, plan)
        assert 0.97 * budget < got <= budget
        resolved = plan.resolve([i.name for i in lm.layers])
        assert all(resolved[i.name] == resolved[i.tied_to] for i in lm.layers if i.tied_to)
        assert all(not resolved[i.name].endswith("-k") or i.shape[1] % 256 == 0 for i in lm.layers)
        damages.append(predict_damage(sens, resolved)["kl_divergence"])
        qm = quantize_model(lm, plan, progress=False)
        path = write_gguf(qm, tmp_path / f"{plan.content_hash()}.gguf")
        assert sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors) == got
    assert damages[0] > damages[1] > damages[2]


def _row_of(run):
    import os
    return {"label": run[0], "pid": os.getpid()}


def test_rows_side_by_side_come_back_in_the_order_of_the_runs():
    """--workers: the workbench rows run on forked worker processes and come back in RUNS' order, as serially."""
    import os
    runs = [(f"row {i}", "rtn", "mirror:Q4_0") for i in range(5)]
    serial = real["run_rows"](runs, _row_of)
    side = real["run_rows"](runs, _row_of, workers=2)
    assert [r["label"] for r in side] == [r["label"] for r in serial] == [r[0] for r in runs]
    assert {r["pid"] for r in serial} == {os.getpid()} and os.getpid() not in {r["pid"] for r in side}
