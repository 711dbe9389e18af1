"""The one-pass proxy score: it ranks layers as measured KL does, and leaves the model as it was."""
from __future__ import annotations

import json

import pytest
import torch

from workbench.errors import PlanError
from workbench.model.load import load_model
from workbench.precision.proxy import proxy_scores, proxy_supported, spearman
from workbench.precision.sensitivity import (AUTO_KL_MAX_WORK, SensitivityReport, choose_score, evaluation_tokens,
                                   run_sensitivity)

TOKENS = 256
DAMAGED = "model.layers.1.mlp.up_proj"


def test_spearman_matches_hand_computed_ranks():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties share their average rank
    assert spearman([1, 1], [1, 2]) != spearman([1, 1], [1, 2])  # nan: no ranking to compare


def test_proxy_ranks_like_measured_kl_and_estimates_its_size(lm):
    ids = evaluation_tokens(lm, tokens=TOKENS)
    kl = run_sensitivity(lm, ids=ids, score="kl", progress=False)
    px = run_sensitivity(lm, ids=ids, score="proxy", progress=False)
    assert (kl.score, px.score) == ("kl", "proxy") and px.score_label.startswith("estimated")
    assert [layer.name for layer in px.layers] == [layer.name for layer in kl.layers]
    for p in ("int8", "int4"):
        measured = [kl.damage(layer.name, p) for layer in kl.layers]
        estimated = [px.damage(layer.name, p) for layer in kl.layers]
        assert spearman(measured, estimated) > 0.8
        assert 0.3 < sum(estimated) / sum(measured) < 3
    assert px.reference_perplexity == pytest.approx(kl.reference_perplexity, rel=1e-4)
    again = SensitivityReport.from_dict(json.loads(json.dumps(px.to_dict())))
    assert again.score == "proxy" and "estimated" in px.to_dict()["metric"]


def test_proxy_ranks_a_deliberately_damaged_layer_first(make_tiny_model):
    lm = load_model(make_tiny_model())
    with torch.no_grad():  # a huge weight on an input that is always 0: harmless in float, but every row's
        lm.model.model.layers[1].post_attention_layernorm.weight[3] = 0  # int4 scale grows and its other
        w = lm.model.get_submodule(DAMAGED).weight  # weights round to 0
        w[:, 3] = 1000 * w.abs().max()
    ids = evaluation_tokens(lm, tokens=TOKENS)
    px = run_sensitivity(lm, ids=ids, score="proxy", progress=False)
    assert px.ranking("int4")[0][0] == DAMAGED
    kl = run_sensitivity(lm, ids=ids, score="kl", progress=False, layers=[DAMAGED, "model.layers.1.mlp.gate_proj"])
    assert kl.ranking("int4")[0][0] == DAMAGED  # the damage is real, not only in the proxy's eyes


def test_proxy_on_a_bfloat16_model_changes_nothing(tiny_model_dir):
    lm = load_model(tiny_model_dir, dtype="bfloat16")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    scores = proxy_scores(lm, evaluation_tokens(lm, tokens=TOKENS), progress=False)
    assert set(scores.damage) == {info.name for info in lm.layers}
    assert all(d["int4"] > d["int8"] > 0 for d in scores.damage.values())
    after = lm.model.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in lm.model.parameters())
    again = proxy_scores(lm, evaluation_tokens(lm, tokens=TOKENS), progress=False)
    assert again.damage == scores.damage  # labels are drawn from a seeded generator


def test_auto_measures_small_sweeps_and_estimates_large_ones(lm):
    assert choose_score(lm, 30, 1024)[0] == "kl"
    score, why = choose_score(lm, 340, 1024 * 100_000)
    assert score == "proxy" and f"{AUTO_KL_MAX_WORK:.0e}" in why
    assert choose_score(lm, 340, 10 ** 9, "kl") == ("kl", "kl asked for")
    with pytest.raises(PlanError, match="score must be"):
        choose_score(lm, 1, 1, "hessian")
    assert proxy_supported(lm.model) and not proxy_supported(torch.nn.Linear(2, 2))


def test_proxy_sweeps_are_cached_apart_from_measured_ones(lm, workspace):
    first = run_sensitivity(lm, tokens=TOKENS, score="proxy", workspace=workspace, progress=False)
    assert first.trials_run == len(first.precisions) * len(lm.layers)
    cached = run_sensitivity(lm, tokens=TOKENS, score="proxy", workspace=workspace, progress=False)
    assert cached.trials_run == 0 and cached.score == "proxy" and "read from the workspace" in cached.score_reason
    measured = run_sensitivity(lm, tokens=TOKENS, score="kl", workspace=workspace, progress=False)
    assert measured.score == "kl" and measured.trials_run == len(measured.precisions) * len(lm.layers)


@pytest.mark.parametrize("settings", [{}, {"group_size": 32, "symmetric": False}, {"group_size": 48}],
                         ids=["g128", "g32-asym", "g48-fallback"])
def test_proxy_scores_the_error_of_the_weights_quantize_model_writes(lm, settings):
    """The proxy's Q(W) is quantize_model's, scale search included: its score of a layer under a Fisher
    matrix is the score of the shipped weights under it."""
    from dataclasses import replace

    from workbench.quantize.plan import QuantPlan
    from workbench.precision.proxy import _weight_error
    from workbench.quantize import quantize_model
    plan = QuantPlan.uniform("int4", keep_embeddings="int8", **settings)
    assert plan.scale_search
    qm = quantize_model(lm, plan, progress=False)
    gen = torch.Generator().manual_seed(0)
    differs = 0
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.embed_tokens"):
        w = lm.model.get_submodule(name).weight.detach().float()
        fisher = torch.rand(w.shape, generator=gen)
        p = qm.layer(name).precision
        shipped = 0.5 * float(((w - qm.weights[name].dequantize()).square() * fisher).sum())
        assert _weight_error(w, fisher, [p], plan)[p] == pytest.approx(shipped, rel=1e-9)
        min_max = _weight_error(w, fisher, [p], replace(plan, scale_search=False))[p]
        differs += min_max != pytest.approx(shipped, rel=1e-6)
    assert differs  # the search changes the score here: a proxy quantizing without it would fail the check above


def test_proxy_refuses_float_precisions(lm):
    with pytest.raises(PlanError, match="integer precisions, not 'fp16'"):
        proxy_scores(lm, evaluation_tokens(lm, tokens=64), ("int4", "fp16"), progress=False)
