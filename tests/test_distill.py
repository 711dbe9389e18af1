"""Distillation: moves the student toward the teacher, resumes exactly, trains quantization-aware, refuses bad input."""
import json

import pytest
import torch

from conftest import Interrupted, interrupt_at
from workbench.compress.distill import (DistillConfig, _remove_fake_quant, attention_head_map, default_layer_map, distill,
                               distillation_loss, fake_quantized, temperature_at)
from workbench.errors import WorkbenchError
from workbench.compress.finetune import CHECKPOINT
from workbench.model.load import load_model
from workbench.quantize.plan import QuantPlan
from workbench.compress.prune import PrunePlan, prune

CFG = DistillConfig(steps=8, batch_size=4, seq_len=32, lr=3e-4, warmup=1, checkpoint_every=3, eval_every=4)


@pytest.fixture(scope="module")
def pruned_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pr") / "pruned"
    listed = {str(i): {"heads_keep": [1], "mlp_keep": list(range(0, 128, 2))} for i in range(2)}
    prune(tiny_model_dir, PrunePlan(layers=listed), out, evaluate_tokens=None, progress=False)
    return out


@pytest.fixture(scope="module")
def distilled(pruned_dir, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("d") / "distilled"
    return out, distill(pruned_dir, tiny_model_dir, out, CFG, eval_tokens=256, progress=False)


def test_distillation_moves_the_student_toward_the_teacher(distilled, pruned_dir):
    out, report = distilled
    assert report.student_after["kl"] < report.student_before["kl"]
    assert report.kl_change["mean"] < 0 and report.kl_change["stderr"] > 0
    assert [s for s, _ in report.validation] == [0, 4, 8]
    assert report.best_step == min(report.validation, key=lambda v: v[1])[0]
    assert report.temperatures[0] == 5.0 and len(report.terms) == CFG.steps and "kl" in report.terms[0]
    lm = load_model(out)
    assert lm.config.num_attention_heads == load_model(pruned_dir).config.num_attention_heads  # same shape
    assert json.loads((out / "distill.json").read_text())["student_after"] == report.student_after
    assert not (out / CHECKPOINT).exists() and not out.with_name(out.name + ".partial").exists()


def test_an_interrupted_run_resumes_to_the_same_result(distilled, pruned_dir, tiny_model_dir, tmp_path):
    _, full = distilled
    out = tmp_path / "resumed"

    with pytest.raises(Interrupted):
        distill(pruned_dir, tiny_model_dir, out, CFG, eval_tokens=256, progress=False, on_step=interrupt_at(5))
    assert (out.with_name("resumed.partial") / CHECKPOINT).is_file()
    again = distill(pruned_dir, tiny_model_dir, out, CFG, eval_tokens=256, progress=False)
    assert again.resumed_from_step == 3
    assert again.losses == pytest.approx(full.losses, rel=1e-4)
    assert again.student_after["kl"] == pytest.approx(full.student_after["kl"], rel=1e-4)


def test_the_temperature_decays_per_epoch_and_never_below_one():
    cfg = DistillConfig(temperature=5.0, temperature_decay=0.1)
    assert [temperature_at(s, 10, cfg) for s in (0, 9, 10, 25)] == pytest.approx([5.0, 5.0, 4.5, 4.05])
    assert temperature_at(10_000, 10, cfg) == 1.0


def test_every_term_is_zero_when_the_student_is_the_teacher(lm):
    lm.model.set_attn_implementation("eager")
    try:
        out = lm.model(input_ids=torch.arange(1, 17)[None], output_hidden_states=True, output_attentions=True)
    finally:
        lm.model.set_attn_implementation("sdpa")
    cfg = DistillConfig(hidden_weight=1.0, attention_weight=1.0)
    total, terms = distillation_loss(out, out, torch.arange(1, 17)[None], cfg, 5.0, default_layer_map(2, 2))
    assert set(terms) == {"kl", "hidden", "attention"} and all(abs(v) < 1e-5 for v in terms.values())
    assert default_layer_map(2, 4) == [1, 3]


def test_the_hidden_and_attention_terms_train(pruned_dir, tiny_model_dir, tmp_path):
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=16, hidden_weight=0.5, attention_weight=0.5, hard_weight=0.1,
                        eval_every=2, validation_fraction=0)
    teacher = load_model(tiny_model_dir)
    flags, attn = [p.requires_grad for p in teacher.model.parameters()], teacher.model.config._attn_implementation
    report = distill(pruned_dir, teacher, tmp_path / "d", cfg, eval_tokens=64, progress=False)
    assert set(report.terms[0]) == {"kl", "hard", "hidden", "attention"} and report.validation == []
    assert report.attention_heads == "per head"  # prune.json says which teacher head each student head is
    # the caller's teacher is as it was: its gradient flags and attention implementation put back
    assert [p.requires_grad for p in teacher.model.parameters()] == flags
    assert teacher.model.config._attn_implementation == attn


@pytest.mark.parametrize("precision", ["int4", "int4-lpbq"])
def test_fake_quantization_is_what_quantize_makes_and_passes_gradients_straight_through(tiny_model_dir, precision):
    from workbench.quantize import quantize_model
    lm = load_model(tiny_model_dir, dtype="float32")
    plan = QuantPlan.uniform(precision, group_size=32)  # two-level scales rounded as quantize_model does too
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        real = quantize_model(lm, plan, method="rtn").build_model()(input_ids=ids).logits
    import copy
    model = copy.deepcopy(lm.model)
    names = fake_quantized(lm, model, plan)
    assert "model.layers.0.mlp.down_proj" in names
    fake = model(input_ids=ids).logits
    assert torch.allclose(fake, real, atol=1e-4)
    fake.sum().backward()
    original = model.model.layers[0].mlp.down_proj.parametrizations.weight.original
    assert original.grad is not None and original.grad.abs().sum() > 0
    _remove_fake_quant(model)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, lm.model.model.layers[0].mlp.down_proj.weight)


@pytest.mark.slow
def test_quantization_aware_distillation_keeps_the_plan(pruned_dir, tiny_model_dir, tmp_path):
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, lr=1e-3)
    plan = QuantPlan.uniform("int4", group_size=32)
    report = distill(pruned_dir, tiny_model_dir, tmp_path / "qat", cfg, plan=plan, eval_tokens=64, progress=False)
    assert report.plan == plan.to_dict() and QuantPlan.load(tmp_path / "qat" / "plan.json") == plan
    assert not any("parametrizations" in k for k in load_model(tmp_path / "qat").model.state_dict())


@pytest.mark.parametrize("kw,message", [
    ({"mode": "lora", "plan": True}, "use mode 'full'"),
    ({"layer_map": (0, 9)}, "layer_map must give a teacher layer"),
    ({"kl_weight": 0.0}, "at least one positive"),
    ({"temperature": 0}, "temperature must be positive"),
    ({"temperature_decay": 1.0}, r"temperature_decay must be in \[0, 1\)"),
    ({"mode": "adapters"}, "mode must be one of"),
])
def test_bad_settings_are_refused_in_one_line(pruned_dir, tiny_model_dir, tmp_path, kw, message):
    plan = QuantPlan.uniform("int4") if kw.pop("plan", False) else None
    with pytest.raises(WorkbenchError, match=message):
        distill(pruned_dir, tiny_model_dir, tmp_path / "x", DistillConfig(steps=1, **kw), plan=plan, progress=False)


def test_a_teacher_with_another_vocabulary_is_refused(pruned_dir, make_tiny_model, tmp_path):
    other = make_tiny_model(vocab_size=4000)
    with pytest.raises(WorkbenchError, match="vocabulary"):
        distill(pruned_dir, other, tmp_path / "x", DistillConfig(steps=1), progress=False)


def test_a_quantized_student_is_refused_naming_its_float_source(tiny_model_dir, tmp_path):
    from workbench.quantize import quantize_model
    lm = load_model(tiny_model_dir)
    quantize_model(lm, QuantPlan.uniform("int4", group_size=32), method="rtn", progress=False).save(tmp_path / "q")
    with pytest.raises(WorkbenchError, match=r"already quantized .*run distill --plan PLAN \(quantization-aware\) on "
                                             r"the float model"):
        distill(tmp_path / "q", tiny_model_dir, tmp_path / "x", DistillConfig(steps=1), progress=False)


@pytest.mark.slow
def test_lora_distillation_trains_adapters_and_saves_a_plain_model(pruned_dir, tiny_model_dir, tmp_path):
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, mode="lora", rank=4, lr=1e-3)
    report = distill(pruned_dir, tiny_model_dir, tmp_path / "lora", cfg, eval_tokens=64, progress=False)
    student = load_model(pruned_dir)
    assert 0 < report.trainable_parameters < sum(p.numel() for p in student.model.parameters())
    saved = load_model(tmp_path / "lora")
    assert [i.name for i in saved.layers] == [i.name for i in student.layers]  # merged: no LoRA modules left


def test_attention_maps_compare_each_student_head_with_the_teacher_head_it_was_cut_from(tiny_model_dir, tmp_path):
    # only the last layer loses heads (query heads 0 and 2 go): its input is the teacher's, so the kept heads'
    # attention maps are the teacher's own; averaged over heads they are not
    out = tmp_path / "pruned"
    plan = PrunePlan(head_unit="query", layers={"1": {"heads_keep": [1, 3]}})
    prune(tiny_model_dir, plan, out, evaluate_tokens=None, progress=False)
    student, teacher = load_model(out, dtype="float32"), load_model(tiny_model_dir, dtype="float32")
    assert student.config.layer_shapes["num_attention_heads"] == [4, 2]  # per-layer counts
    head_map = attention_head_map(student, teacher, [0, 1])
    assert head_map == [[0, 1, 2, 3], [1, 3]]
    ids = torch.arange(1, 17)[None]
    outs = []
    for lm in (student, teacher):
        lm.model.set_attn_implementation("eager")
        with torch.no_grad():
            outs.append(lm.model(input_ids=ids, output_attentions=True))
    cfg = DistillConfig(kl_weight=0.0, attention_weight=1.0)
    _, per_head = distillation_loss(outs[0], outs[1], ids, cfg, 1.0, [0, 1], head_map)
    _, averaged = distillation_loss(outs[0], outs[1], ids, cfg, 1.0, [0, 1])
    assert per_head["attention"] < 1e-10 < averaged["attention"]
    # no mapping to trust: another layer map, or a student that was not pruned, compares head-averaged maps
    assert attention_head_map(student, teacher, [1, 1]) is None
    assert attention_head_map(teacher, teacher, [0, 1]) is None


@pytest.mark.slow
def test_chunked_loss_and_gradient_checkpointing_train_exactly_as_the_whole_batch(pruned_dir, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """The soft labels a few tokens at a time (recomputed in backward) and blocks recomputed in backward change
    memory, not the training: the same losses step by step."""
    import workbench.numerics.logits as logits
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, mode="lora", rank=4, lr=1e-3, hard_weight=0.5)
    whole = distill(pruned_dir, tiny_model_dir, tmp_path / "a", cfg, eval_tokens=64, progress=False)
    monkeypatch.setattr(logits, "LOSS_CHUNK_ELEMENTS", 7 * 4096)  # 7 rows per chunk of the tiny vocabulary
    from dataclasses import replace
    chunked = distill(pruned_dir, tiny_model_dir, tmp_path / "b", replace(cfg, gradient_checkpointing=True),
                      eval_tokens=64, progress=False)
    assert chunked.losses == pytest.approx(whole.losses, rel=1e-4)
    assert chunked.validation[-1][1] == pytest.approx(whole.validation[-1][1], rel=1e-4)
    assert chunked.student_after["kl"] == pytest.approx(whole.student_after["kl"], rel=1e-4)


@pytest.mark.slow
def test_a_16_bit_lora_student_stays_16_bit_and_trains_the_same_with_gradient_checkpointing(pruned_dir, tiny_model_dir,
                                                                                          tmp_path):
    """LoRA over frozen bfloat16 weights (float32 arithmetic, no float32 copies kept for backward): blocks recomputed
    in backward give the same losses, and the saved student is bfloat16 like its source."""
    import shutil
    from dataclasses import replace

    from transformers import AutoModelForCausalLM
    half = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(pruned_dir, dtype=torch.bfloat16).save_pretrained(half)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pruned_dir / f, half / f)
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, mode="lora", rank=4, lr=1e-3)
    plain = distill(half, tiny_model_dir, tmp_path / "a", cfg, eval_tokens=64, progress=False)
    recomputed = distill(half, tiny_model_dir, tmp_path / "b", replace(cfg, gradient_checkpointing=True),
                         eval_tokens=64, progress=False)
    assert plain.losses[0] > 1e-3 and recomputed.losses == pytest.approx(plain.losses, rel=1e-4)
    assert recomputed.student_after["kl"] == pytest.approx(plain.student_after["kl"], rel=1e-4)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
