"""Structured pruning: the sliced model is the original with those units removed, smaller, loadable, exportable."""
import json

import pytest
import torch

from workbench.errors import PlanError
from workbench.evaluation.evaluate import evaluate
from workbench.model.load import load_model
from workbench.compress.prune import (PruneImportance, PrunePlan, geometry, head_and_channel_importance, prune, prune_model)
from workbench.precision.sensitivity import evaluation_tokens

IDS = torch.arange(1, 49)[None] * 37 % 4000


def _masked_logits(model, kept_heads_per_layer, kept_channels_per_layer, head_dim):
    """The original model with every removed query head's o_proj input and removed MLP channel zeroed."""
    handles = []
    for i, block in enumerate(model.model.layers):
        heads, ch = kept_heads_per_layer[i], kept_channels_per_layer[i]

        def zero_heads(module, args, heads=heads):
            x = args[0].clone()
            keep = torch.zeros(x.shape[-1], dtype=torch.bool)
            for h in heads:
                keep[h * head_dim:(h + 1) * head_dim] = True
            x[..., ~keep] = 0
            return (x,)

        def zero_channels(module, args, ch=ch):
            x = args[0].clone()
            keep = torch.zeros(x.shape[-1], dtype=torch.bool)
            keep[list(ch)] = True
            x[..., ~keep] = 0
            return (x,)
        handles += [block.self_attn.o_proj.register_forward_pre_hook(zero_heads),
                    block.mlp.down_proj.register_forward_pre_hook(zero_channels)]
    try:
        with torch.no_grad():
            return model(input_ids=IDS).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch,unit", [("qwen3", "group"), ("qwen3", "query"), ("qwen2", "group"), ("llama", "query")])
def test_the_pruned_model_is_the_original_with_those_units_removed(make_tiny_model, arch, unit):
    lm = load_model(make_tiny_model(arch, heads=8, kv_heads=2, hidden=64, intermediate=96), dtype="float32")
    geo = geometry(lm.model)
    plan = PrunePlan(head_unit=unit, layers={
        "0": {"heads_keep": [1] if unit == "group" else [0, 2, 5, 7], "mlp_keep": list(range(0, 96, 2))},
        "1": {"heads_keep": [0] if unit == "group" else [1, 3, 4, 6], "mlp_keep": list(range(48))}})
    result = prune_model(lm, plan)
    kept_q = [[k * geo.group + j for k in layer for j in range(geo.group)] if unit == "group" else layer
              for layer in result.kept["heads"]]
    with torch.no_grad():
        pruned = result.model(input_ids=IDS).logits
    assert torch.allclose(pruned, _masked_logits(lm.model, kept_q, result.kept["mlp"], geo.head_dim), atol=1e-5)
    after = result.geometry_after
    assert (after["heads"], after["kv_heads"], after["intermediate"]) == \
        ((4, 1, 48) if unit == "group" else (4, 2, 48))
    assert result.model.config.head_dim == geo.head_dim  # explicit: no longer hidden / heads
    assert result.parameters_after == result.parameters_predicted < result.parameters_before


@pytest.fixture(scope="module")
def importance(lm):
    return head_and_channel_importance(lm, tokens=512, seq_len=64, kl_tokens=256, progress=False)


def test_importance_scores_every_unit_and_kl_says_which_group_matters(lm, importance):
    geo = geometry(lm.model)
    assert len(importance.taylor_heads) == geo.layers and len(importance.taylor_heads[0]) == geo.heads
    assert len(importance.taylor_mlp[0]) == geo.intermediate
    assert len(importance.kl_groups[0]) == geo.kv_heads and len(importance.kl_heads[0]) == geo.heads
    assert all(v > 0 for row in importance.kl_groups for v in row)  # masking anything changes the output
    assert all(v >= 0 for row in importance.taylor_mlp for v in row)
    # a group's score is its query heads' sum
    g = geo.group
    assert importance.scores("heads", 0, "taylor")[1] == pytest.approx(sum(importance.taylor_heads[0][g:2 * g]))


def test_a_unit_that_does_nothing_scores_zero_and_goes_first(tiny_model_dir):
    lm = load_model(tiny_model_dir, dtype="float32")
    geo = geometry(lm.model)
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight[:, 5] = 0  # channel 5 of layer 0 reaches nothing
        lm.model.model.layers[0].self_attn.o_proj.weight[:, :geo.head_dim * geo.group] = 0  # KV group 0 too
    imp = head_and_channel_importance(lm, tokens=256, seq_len=64, measure_kl=False, progress=False)
    assert imp.taylor_mlp[0][5] == 0 and imp.activation_mlp[0][5] == 0
    assert imp.scores("heads", 0, "taylor")[0] == 0
    kept = PrunePlan(heads=0.5, mlp=0.01, mlp_multiple=1).keep(geo, imp)  # 3 of 256 channels: the zero one first
    assert 5 not in kept["mlp"][0] and kept["heads"][0] == [1]


def test_importance_is_cached_in_the_workspace(lm, workspace, monkeypatch):
    first = head_and_channel_importance(lm, tokens=256, seq_len=64, kl_tokens=128, workspace=workspace,
                                        progress=False)
    import workbench.compress.prune as prune_mod
    monkeypatch.setattr(prune_mod, "_gradient_scores", lambda *a, **k: pytest.fail("recomputed"))
    again = head_and_channel_importance(lm, tokens=256, seq_len=64, kl_tokens=128, workspace=workspace,
                                        progress=False)
    assert again.to_dict() == first.to_dict()
    assert [a.step for a in workspace.list()] == ["prune-importance"]


def test_prune_writes_a_smaller_directory_that_loads_and_exports_with_parity(lm, tiny_model_dir, tmp_path, workspace):
    out = tmp_path / "pruned"
    uniform = PrunePlan(heads=0.5, mlp=0.25, spread="layer")  # every layer the same counts: a plain config
    report = prune(tiny_model_dir, uniform, out, workspace=workspace, evaluate_tokens=256, progress=False)
    pruned = load_model(out)
    assert sum(p.numel() for p in pruned.model.parameters()) == report["parameters_predicted"] == \
        report["parameters_after"] < report["parameters_before"]
    assert (pruned.config.num_attention_heads, pruned.config.num_key_value_heads, pruned.config.intermediate_size) \
        == (2, 1, 96)
    assert "layer_shapes" not in json.loads((out / "config.json").read_text())
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(out) < size(tiny_model_dir)
    saved = json.loads((out / "prune.json").read_text())
    assert saved["kept"] == report["kept"] and saved["evaluation"]["kl"] > 0
    ids = evaluation_tokens(pruned, None, 256)
    ev = report["evaluation"]
    assert evaluate(pruned.model, ids, ctx=min(256, ids.numel()), progress=False).perplexity == \
        pytest.approx(ev["perplexity_after"], rel=1e-3)
    assert json.loads((out / "manifest.json").read_text())["format"] == "workbench-prune"
    from workbench.onnx.export import export_onnx
    result = export_onnx(pruned, tmp_path / "onnx", greedy_steps=8)
    assert result.max_abs_diff < 1e-3 and result.greedy_match_steps == 8


def test_a_plan_round_trips_and_explicit_lists_need_no_importance(tmp_path, lm):
    plan = PrunePlan(heads=0.5, mlp=0.25, layers={"1": {"mlp_keep": list(range(96))}}, mlp_multiple=32)
    assert PrunePlan.load(plan.save(tmp_path / "p.json")) == plan
    listed = PrunePlan(layers={str(i): {"heads_keep": [1], "mlp_keep": list(range(64))} for i in range(2)})
    result = prune_model(lm, listed)
    assert result.kept["heads"] == [[1], [1]] and result.geometry_after["intermediate"] == 64


@pytest.mark.parametrize("plan,message", [
    (lambda: PrunePlan(heads=1.0), "1 would remove every unit"),
    (lambda: PrunePlan(mlp=-0.1), r"fraction removed in \[0, 1\)"),
    (lambda: PrunePlan(head_unit="row"), "head_unit must be one of"),
    (lambda: PrunePlan(layers={"0": {"heads": 0.5, "heads_keep": [0]}}), "not both"),
    (lambda: PrunePlan(layers={"0": {"head": 0.5}}), "unknown field"),
    (lambda: PrunePlan.from_dict({"heads": 0.5, "ratio": 1}), "unknown field"),
])
def test_bad_plans_are_refused_in_one_line(plan, message):
    with pytest.raises(PlanError, match=message):
        plan()


@pytest.mark.parametrize("plan,message", [
    (PrunePlan(layers={"7": {"heads": 0.5}}), r"names layer '7'; the model has layers 0-1"),
    (PrunePlan(heads=0.9, head_unit="query", spread="layer"), "leaves a group with none"),
    (PrunePlan(heads=0.9, spread="layer"), "leaves none"),
    (PrunePlan(heads=0.9), r"leaves none in a layer \(each keeps at least one KV group\); lower heads \(at most 50%\)"),
    (PrunePlan(heads=0.9, head_unit="query"), "each keeps at least one head per KV group"),
    (PrunePlan(layers={"0": {"heads_keep": [0, 0]}, "1": {"heads_keep": [0, 1]}}), "lists an index twice"),
    (PrunePlan(layers={"0": {"heads_keep": [5]}}), r"names KV groups \[5\]; the model has 2"),
    (PrunePlan(head_unit="query", layers={str(i): {"heads_keep": [0, 1]} for i in range(2)}),
     "keeps no query head of KV group 1"),
])
def test_plans_that_do_not_fit_the_model_are_refused(lm, importance, plan, message):
    with pytest.raises(PlanError, match=message):
        prune_model(lm, plan, importance)


def test_a_ratio_without_importance_and_a_quantized_model_are_refused(lm):
    with pytest.raises(PlanError, match="needs importance scores"):
        prune_model(lm, PrunePlan(mlp=0.5))
    with pytest.raises(PlanError, match="computed without it"):
        PruneImportance("m", 1, {"heads": 4, "kv_heads": 2}, [[1] * 4], [[1]], [[1] * 4], [[1]]).scores(
            "heads", 0, "kl")


def test_a_version_1_plan_reads_as_one_count_for_every_layer():
    plan = PrunePlan.from_dict({"heads": 0.5, "mlp": 0.25, "head_unit": "group", "score": "taylor",
                                "mlp_multiple": 1, "layers": {}, "version": 1})
    assert (plan.spread, plan.keep_first_last, plan.mlp_multiple, plan.version) == ("layer", False, 1, 2)
    with pytest.raises(PlanError, match="version 2 fields"):
        PrunePlan.from_dict({"heads": 0.5, "spread": "global", "version": 1})


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny Qwen3 of four layers (the demo's shape, smaller) and its importance scores."""
    from tests.conftest import build_tiny_model
    lm = load_model(build_tiny_model(tmp_path_factory.mktemp("deep") / "qwen3", layers=4), dtype="float32")
    return lm, head_and_channel_importance(lm, tokens=512, seq_len=64, measure_kl=False, progress=False)


@pytest.mark.parametrize("unit", ["group", "query"])
def test_a_global_ratio_comes_from_the_middle_layers_least_important_units(deep, unit):
    lm, imp = deep
    geo = geometry(lm.model)
    plan = PrunePlan(heads=0.25, mlp=0.2, head_unit=unit)
    shapes = plan.layer_counts(geo, imp)
    assert shapes[0] == shapes[-1] == (4, 2, 128)  # the first and last layers whole
    assert sum(s[0] for s in shapes) == 12  # 25% of the model's 16 query heads, all from layers 1 and 2
    assert all(s[2] % 32 == 0 for s in shapes) and sum(s[2] for s in shapes) == 512 - 96  # 20% of 512 -> 3 x 32
    if unit == "group":  # one KV group from each middle layer: each must keep one
        assert [s[1] for s in shapes] == [2, 1, 1, 2]
    else:  # query heads: every KV head stays
        assert [s[1] for s in shapes] == [2, 2, 2, 2]
    # each middle layer loses its least important channels; the least important of both goes first
    kept = plan.keep(geo, imp)
    scores = imp.taylor_mlp
    for i in (1, 2):
        gone = [scores[i][c] for c in range(128) if c not in kept["mlp"][i]]
        assert not gone or max(gone) <= min(scores[i][c] for c in kept["mlp"][i])
    lowest = min((scores[i][c], i, c) for i in (1, 2) for c in range(128))
    assert lowest[2] not in kept["mlp"][lowest[1]]
    with pytest.raises(PlanError, match=r"from layer\(s\) 1, 2 alone leaves none .*at most 25%.*--prune-first-last"):
        PrunePlan(heads=0.5, head_unit=unit).keep(geo, imp)
    # without importance the counts differ by layer but the totals, and so the parameters, are the same
    blind = plan.layer_counts(geo)
    assert [sum(s[k] for s in blind) for k in range(3)] == [sum(s[k] for s in shapes) for k in range(3)]


def test_per_layer_counts_give_a_directory_that_loads_exports_quantizes_and_matches_the_plan(deep, tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.onnx.export import export_onnx
    from workbench.model.load import LAYER_SHAPES
    from workbench.quantize.plan import QuantPlan
    from workbench.compress.prune import head_mapping, predicted_size, save_pruned
    from workbench.quantize import quantize_model
    lm, imp = deep
    plan = PrunePlan(heads=0.25, mlp=0.2)
    result = prune_model(lm, plan, imp)
    out = save_pruned(result, lm, tmp_path / "pruned")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg[LAYER_SHAPES]["num_attention_heads"] == [4, 2, 2, 4] and cfg["num_attention_heads"] == 4
    assert cfg[LAYER_SHAPES]["num_key_value_heads"] == [2, 1, 1, 2]
    report = result.report()
    assert report["heads_removed"] == 0.25 and report["mlp_removed"] == pytest.approx(96 / 512)
    pruned = load_model(out)
    counted = sum(p.numel() for p in pruned.model.parameters())
    assert counted == result.parameters_predicted == result.parameters_after == predicted_size(lm, plan)["parameters"]
    with torch.no_grad():
        assert torch.allclose(pruned.model(input_ids=IDS).logits, result.model(input_ids=IDS).logits, atol=1e-5)
    # the model is the original with those units removed
    kept_q = head_mapping(out)
    assert kept_q[0] == [0, 1, 2, 3] and len(kept_q[1]) == 2
    with torch.no_grad():
        assert torch.allclose(pruned.model(input_ids=IDS).logits,
                              _masked_logits(lm.model, kept_q, result.kept["mlp"], 16), atol=1e-5)
    export = export_onnx(pruned, tmp_path / "onnx", greedy_steps=8)
    assert export.max_abs_diff < 1e-3 and export.greedy_match_steps == 8
    qm = quantize_model(pruned, QuantPlan.uniform("int4", group_size=32), method="rtn", progress=False)
    ids = evaluation_tokens(pruned, None, 256)
    ev = evaluate(qm.build_model(), ids, reference=pruned.model, ctx=128, progress=False)
    assert 0 < ev.kl_divergence < 1
    qm.save(tmp_path / "int4")
    assert load_model(tmp_path / "int4").parameters == counted  # codes counted as the weights they replace
    from workbench.devices.projection import model_shape, project  # shapes on the meta device, KV cache per layer
    assert sum(p.numel() for p in model_shape(out).model.parameters()) == counted
    kv = [project(d, "snapdragon-8-gen-3").kv_bytes_per_token for d in (out, lm.path)]
    assert kv[0] * 8 == kv[1] * 6  # 6 of the 8 KV heads are left
    # plain transformers builds every layer at the largest counts: the weights do not fit
    with pytest.raises(Exception, match="size mismatch|mismatch|shape"):
        AutoModelForCausalLM.from_pretrained(out, ignore_mismatched_sizes=False)


def test_a_broken_layer_shapes_field_is_refused_in_one_line(deep, tmp_path):
    from workbench.errors import ModelLoadError
    from workbench.compress.prune import save_pruned
    lm, imp = deep
    out = save_pruned(prune_model(lm, PrunePlan(heads=0.25), imp), lm, tmp_path / "p")
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_shapes"]["num_key_value_heads"] = [2, 1]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="lists of 4 positive integers"):
        load_model(out)
    with pytest.raises(PlanError, match="already pruned to per-layer shapes"):
        cfg["layer_shapes"]["num_key_value_heads"] = [2, 1, 1, 2]
        (out / "config.json").write_text(json.dumps(cfg))
        geometry(load_model(out).model)
