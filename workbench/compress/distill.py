"""Distillation: win back what pruning (and quantization) cost, with the original model as the teacher.

    report = distill("out/pruned", "demo", "out/distilled", DistillConfig(steps=300))
    report = distill("out/pruned", "demo", "out/qat", plan=QuantPlan.uniform("int4"))   # quantization-aware
    report.student_before, report.student_after      # held-out perplexity and KL to the teacher

Losses (weights in ``DistillConfig``): the teacher's soft labels, ``T^2 KL(softmax(t/T) || softmax(s/T))``
with ``T`` starting at ``temperature`` and shrinking by ``temperature_decay`` each epoch over the
training windows; optionally the cosine distance between hidden states and the mean squared error
between head-averaged attention maps of mapped layers (student layer ``i`` to teacher layer
``layer_map[i]``, by default the same depth, stretched when the student has fewer layers), and the
hard-label cross-entropy. Pruned students keep the teacher's hidden size, so hidden states compare
directly. Attention maps compare head by head when the student is a pruned directory whose
``prune.json`` says which teacher head each of its heads is (every layer kept, each its own head
count); otherwise, with no such mapping, they are averaged over heads, since the student has fewer.

The student trains whole (``mode="full"``) or through LoRA adapters (``mode="lora"``). With a
``plan`` the student is trained quantization-aware: every layer the plan quantizes computes, in
the forward pass, with its round-to-nearest weight (the same ``quantize_weight`` ``workbench
quantize`` uses) and passes the gradient straight through to the float weight, so quantizing the
result with that plan gives exactly the weights trained. QAT needs ``mode="full"``: LoRA's merged
update would be rounded after training, not during it.

The training loop, checkpoint/resume and held-out step selection are fine-tuning's
(``finetune.run_training``); the step kept is the one with the lowest KL to the teacher (T = 1) on
held-back windows.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import WorkbenchError
from ..numerics.compute import enable_float32_compute, narrow_saved_weights, stored_dtype
from ..evaluation.evaluate import EvalReport, check_plain_head, capture_reference, evaluate, paired_difference
from ..numerics.logits import chunked_sum, final_hidden, head_logits, loss_chunk_rows, trainable_head_logits
from .finetune import (CHECKPOINT, DEFAULT_TARGETS, Checkpoint, split_windows, run_training, save_model_directory,
                       source_dtype, training_token_budget, training_windows)
from ..assets import demo_text_path
from ..model.load import LoadedModel, load_model
from ..evaluation.textio import text_token_ids
from ..quantize.plan import QuantPlan, get_precision
from ..files.workspace import atomic_write_json, check_output_dir, file_sha256, hash_inputs, swap_into_place, \
    write_output_manifest
from ..files.workspace import model_fingerprint
from ..quantize import layer_quantizer

__all__ = ["DistillConfig", "DistillReport", "distill", "distillation_loss", "attention_head_map", "fake_quantized",
           "temperature_at", "DISTILL_FORMAT", "MODES"]

DISTILL_FORMAT = "workbench-distill"
REPORT = "distill.json"
PLAN_FILE = "plan.json"
MODES = ("full", "lora")


@dataclass(frozen=True)
class DistillConfig:
    """What a run does; every field is part of the checkpoint key (a changed setting starts afresh)."""

    steps: int = 300
    lr: float = 1e-4  # a tenth of a typical training rate, as the field practice advises after pruning
    warmup: int = 10
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    checkpoint_every: int = 25
    validation_fraction: float = 0.1
    eval_every: int = 25
    temperature: float = 5.0
    temperature_decay: float = 0.1  # per epoch over the training windows
    kl_weight: float = 1.0
    hard_weight: float = 0.0
    hidden_weight: float = 0.0
    attention_weight: float = 0.0
    layer_map: tuple[int, ...] | None = None
    mode: str = "full"
    rank: int = 8
    alpha: int = 16
    gradient_checkpointing: bool = False  # keep each block's input only, recompute its activations in backward

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every", "eval_every", "rank", "alpha"):
            if getattr(self, name) < 1:
                raise WorkbenchError(f"distillation: {name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise WorkbenchError(f"distillation: lr must be positive, got {self.lr}")
        if not self.temperature > 0:
            raise WorkbenchError(f"distillation: temperature must be positive, got {self.temperature}")
        if not 0 <= self.temperature_decay < 1:
            raise WorkbenchError(f"distillation: temperature_decay must be in [0, 1), got {self.temperature_decay}")
        if not 0 <= self.validation_fraction < 1:
            raise WorkbenchError("distillation: validation_fraction must be in [0, 1), got "
                                 f"{self.validation_fraction}")
        weights = {k: getattr(self, f"{k}_weight") for k in ("kl", "hard", "hidden", "attention")}
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise WorkbenchError(f"distillation: loss weights must be >= 0 with at least one positive, got {weights}")
        if self.mode not in MODES:
            raise WorkbenchError(f"distillation: mode must be one of {', '.join(MODES)}, got {self.mode!r}")


def temperature_at(step: int, steps_per_epoch: int, cfg: DistillConfig) -> float:
    """The soft-label temperature: ``temperature`` shrinking by ``temperature_decay`` per epoch (floor 1)."""
    epoch = step // max(1, steps_per_epoch)
    return max(1.0, cfg.temperature * (1 - cfg.temperature_decay) ** epoch)


def attention_head_map(student: LoadedModel, teacher: LoadedModel,
                       layer_map: Sequence[int]) -> list[list[int]] | None:
    """Per student layer, the teacher head each student head was cut from (``prune.json`` beside the student),
    when the student was pruned from this teacher layer for layer; None (head-averaged maps) otherwise."""
    from .prune import head_mapping
    mapping = head_mapping(student.path)
    if mapping is None or list(layer_map) != list(range(len(mapping))):
        return None
    t_heads = teacher.config.num_attention_heads
    for i, (block, heads) in enumerate(zip(student.model.model.layers, mapping)):
        attn = block.self_attn
        if attn.q_proj.out_features != len(heads) * attn.head_dim or not all(0 <= h < t_heads for h in heads):
            return None  # not this teacher's pruning (or layers changed since): no mapping to trust
    return mapping


def default_layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """Student layer i to the teacher layer at the same relative depth (the same index at equal depth)."""
    if student_layers == teacher_layers:
        return list(range(student_layers))
    return [round((i + 1) * teacher_layers / student_layers) - 1 for i in range(student_layers)]


def distillation_loss(student_out, teacher_out, labels: torch.Tensor, cfg: DistillConfig, temperature: float,
                      layer_map: Sequence[int], head_map: Sequence[Sequence[int]] | None = None,
                      heads: tuple[nn.Module, nn.Module] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of the configured terms, and each term's value (for the report).

    ``head_map[i]``: the teacher head (in layer ``layer_map[i]``) of each of student layer ``i``'s
    heads; the attention term then compares those pairs, else head-averaged maps.
    With ``heads`` (the student's and the teacher's output layers) the outputs are the decoders' (final
    hidden states instead of logits) and the soft- and hard-label terms are summed a chunk of tokens at a
    time: tokens x vocabulary (1.2 GB in float32 for 2,048 tokens of a Qwen vocabulary) is never held
    for the whole batch.
    """
    terms: dict[str, torch.Tensor] = {}
    if cfg.kl_weight > 0 or cfg.hard_weight > 0:
        terms.update(_label_terms(student_out, teacher_out, labels, cfg, temperature, heads))
    if cfg.hidden_weight > 0:
        hs, ht = student_out.hidden_states, teacher_out.hidden_states
        terms["hidden"] = torch.stack([1 - F.cosine_similarity(hs[i + 1].float(), ht[j + 1].float(), dim=-1).mean()
                                       for i, j in enumerate(layer_map)]).mean()
    if cfg.attention_weight > 0:
        a_s, a_t = student_out.attentions, teacher_out.attentions
        if head_map is not None:
            pairs = [(a_s[i].float(), a_t[j][:, list(head_map[i])].float()) for i, j in enumerate(layer_map)]
        else:
            pairs = [(a_s[i].float().mean(1), a_t[j].float().mean(1)) for i, j in enumerate(layer_map)]
        terms["attention"] = torch.stack([F.mse_loss(s, t) for s, t in pairs]).mean()
    total = sum(getattr(cfg, f"{k}_weight") * v for k, v in terms.items())
    return total, {k: float(v.detach()) for k, v in terms.items()}


def _label_terms(student_out, teacher_out, labels: torch.Tensor, cfg: DistillConfig, temperature: float,
                 heads: tuple[nn.Module, nn.Module] | None) -> dict[str, torch.Tensor]:
    """``T^2 KL(teacher || student)`` at temperature ``T`` and the hard-label cross-entropy, means over positions."""
    if heads is None:  # logits given
        s_rows, t_rows, (s_head, t_head) = student_out.logits[:, :-1], teacher_out.logits[:, :-1], (None, None)
    else:
        s_rows, t_rows, (s_head, t_head) = student_out.last_hidden_state[:, :-1], \
            teacher_out.last_hidden_state[:, :-1], heads
    vocab = s_rows.shape[-1] if s_head is None else s_head.weight.shape[0]
    s_rows, t_rows = s_rows.reshape(-1, s_rows.shape[-1]), t_rows.reshape(-1, t_rows.shape[-1])
    kl, hard = cfg.kl_weight > 0, cfg.hard_weight > 0

    def sums(s, t, y):
        s_logits = s.float() if s_head is None else trainable_head_logits(s_head, s)
        out = []
        if kl:
            with torch.no_grad():  # the teacher's head widened a slice at a time, never a float32 copy whole
                t_logits = t.float() if t_head is None else head_logits(t_head, t).clone()
            out.append(F.kl_div(F.log_softmax(s_logits / temperature, -1), F.log_softmax(t_logits / temperature, -1),
                                log_target=True, reduction="sum"))
        if hard:
            out.append(F.cross_entropy(s_logits, y, reduction="sum"))
        return tuple(out)
    totals = iter(chunked_sum(sums, s_rows, t_rows, labels[:, 1:].reshape(-1).clone(), chunk=loss_chunk_rows(vocab)))
    n, terms = s_rows.shape[0], {}
    if kl:
        terms["kl"] = next(totals) / n * temperature ** 2
    if hard:
        terms["hard"] = next(totals) / n
    return terms


# -- quantization-aware training ------------------------------------------------------------------

class _FakeQuant(nn.Module):
    """A weight parametrization: the plan's rounding forward (``quantizer``: ``layer_quantizer``'s, the one
    ``quantize_model`` uses; None: float16), identity backward."""

    def __init__(self, quantizer=None):
        super().__init__()
        self.quantizer = quantizer

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.quantizer is None:  # fp16: the weight rounded to float16 values
            q = w.detach().half().to(w.dtype)
        else:
            q = self.quantizer.quantize(w).dequantize().to(w.dtype)
        return w + (q - w).detach()  # straight-through: the gradient reaches the float weight unchanged


def fake_quantized(lm: LoadedModel, model: nn.Module, plan: QuantPlan) -> list[str]:
    """Parametrize every layer ``plan`` lowers with ``_FakeQuant``; returns their names.

    A tied embedding / output layer shares one weight: both modules get the parametrization over
    that same tensor, so the tie holds in training and after ``_remove_fake_quant``.
    """
    from torch.nn.utils import parametrize
    assignments = plan.resolve([info.name for info in lm.layers])
    names = []
    for info in lm.layers:
        prec = get_precision(assignments.get(info.name))
        if prec is None or (prec.is_float and prec.bits >= 32):
            continue
        quantizer = None if prec.is_float else layer_quantizer(plan, prec, tuple(info.shape), name=info.name)
        parametrize.register_parametrization(model.get_submodule(info.name), "weight", _FakeQuant(quantizer),
                                             unsafe=True)
        names.append(info.name)
    return names


def _remove_fake_quant(model: nn.Module) -> None:
    """Back to plain float weights (the trained ones, not their rounded copies)."""
    from torch.nn.utils import parametrize
    for m in list(model.modules()):
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)


# -- the run ---------------------------------------------------------------------------------------

@dataclass
class DistillReport:
    """Losses per step, the step kept, and the student before / after against the teacher."""

    out_dir: str
    config: dict
    teacher: str
    student: str
    plan: dict | None
    train_windows: int
    trainable_parameters: int
    losses: list[float] = field(default_factory=list)
    terms: list[dict] = field(default_factory=list)  # each loss term per step
    temperatures: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, KL to the teacher at T = 1)
    best_step: int | None = None
    validation_windows: int = 0
    teacher_perplexity: float | None = None
    student_before: dict | None = None  # perplexity, KL, top-1 and their standard errors
    student_after: dict | None = None
    perplexity_change: dict | None = None  # after - before in mean NLL, with its standard error
    kl_change: dict | None = None
    recovered: float | None = None  # share of the student's perplexity gap to the teacher that was won back
    eval_tokens: int = 0
    seconds: float = 0.0
    resumed_from_step: int | None = None
    attention_heads: str | None = None  # "per head" (pruning's mapping) or "averaged"; None without the term

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        b, a = self.student_before or {}, self.student_after or {}
        q = " quantization-aware" if self.plan else ""
        rec = f", {self.recovered:.0%} of the gap won back" if self.recovered is not None else ""
        return (f"distilled{q} ({self.config['mode']}, {self.trainable_parameters:,} trainable) for {len(self.losses)} "
                f"steps, kept step {self.best_step}; held-out perplexity {b.get('perplexity', float('nan')):.2f} -> "
                f"{a.get('perplexity', float('nan')):.2f} (teacher {self.teacher_perplexity:.2f}{rec}), KL "
                f"{b.get('kl', float('nan')):.4f} -> {a.get('kl', float('nan')):.4f} on {self.eval_tokens:,} tokens; "
                f"{self.seconds:.0f} s -> {self.out_dir}")


def _measure(report: EvalReport) -> dict:
    return {"perplexity": report.perplexity, "perplexity_stderr": report.perplexity_stderr,
            "kl": report.kl_divergence, "kl_stderr": report.kl_stderr, "top1": report.top1_agreement}


def _trainable(model: nn.Module, cfg: DistillConfig):
    """(the module to train, snapshot(), restore(state)): LoRA adapters on the student, or all its weights."""
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
        torch.manual_seed(cfg.seed)  # LoRA's A matrices start random
        present = {n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
        trained = get_peft_model(model, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, bias="none",
                                                   target_modules=[t for t in DEFAULT_TARGETS if t in present],
                                                   task_type="CAUSAL_LM"))
        return (trained, lambda: {k: v.detach().clone() for k, v in get_peft_model_state_dict(trained).items()},
                lambda state: set_peft_model_state_dict(trained, state))
    for p in model.parameters():
        p.requires_grad_(True)
    named = dict(model.named_parameters())

    @torch.no_grad()
    def restore(state: dict) -> None:
        for k, v in state.items():
            named[k].copy_(v)
    return model, lambda: {k: v.detach().clone() for k, v in named.items()}, restore


@contextlib.contextmanager
def _teacher(model: nn.Module, *, eager: bool):
    """The teacher frozen, in eval mode (and eager attention for attention maps); put back as it was after."""
    flags, training, attn = [p.requires_grad for p in model.parameters()], model.training, \
        model.config._attn_implementation
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        if eager:
            model.set_attn_implementation("eager")
        yield model
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(training)
        if eager:
            model.set_attn_implementation(attn)


def _outputs(model: nn.Module, batch: torch.Tensor, cfg: DistillConfig, plain: bool = False):
    """The model's outputs; ``plain`` (logits are ``lm_head(final hidden)``): the decoder's, without logits."""
    run = model.get_decoder() if plain else model
    return run(input_ids=batch, use_cache=False, output_hidden_states=cfg.hidden_weight > 0,
               output_attentions=cfg.attention_weight > 0)


def distill(student: str | Path | LoadedModel, teacher: str | Path | LoadedModel = "demo",
            out_dir: str | Path = "out/distilled", config: DistillConfig | None = None, *,
            plan: QuantPlan | None = None, data: str | Path | None = None, eval_text: str | Path | None = None,
            eval_tokens: int = 4096, overwrite: bool = False, progress: bool = True,
            on_step: Callable[[int, float], None] | None = None) -> DistillReport:
    """Train ``student`` to match ``teacher`` on ``data`` (default: the calibration text); save the student.

    ``plan`` makes it quantization-aware (the plan's layers fake-quantized in the forward pass);
    the saved model is float, and ``workbench quantize`` with the same plan gives the weights
    trained. Work in progress lives in ``<out_dir>.partial/`` and resumes from its last checkpoint.
    Perplexity and KL to the teacher before and after (with the plan's rounding when given) are
    measured on ``eval_text`` (default: the bundled held-out text), never used for choosing.
    """
    cfg = config or DistillConfig()
    cfg.validate()
    if plan is not None and cfg.mode != "full":
        raise WorkbenchError("quantization-aware distillation trains the weights that get rounded: use mode 'full' "
                             "(--mode full), not LoRA")
    out = check_output_dir(out_dir, DISTILL_FORMAT)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise WorkbenchError(f"--out '{out}' holds an earlier distilled model; pass --overwrite (overwrite=True) to "
                             "replace it, or choose another --out")
    t0 = time.perf_counter()
    # LoRA trains adapters over frozen weights: those stay in their stored dtype (float32 arithmetic all the same);
    # full fine-tuning updates every weight, in float32
    s_lm = student if isinstance(student, LoadedModel) else \
        load_model(student, dtype="float32" if cfg.mode == "full" else "auto")
    s_lm.require_float("distill --plan PLAN (quantization-aware)")
    t_lm = teacher if isinstance(teacher, LoadedModel) else load_model(teacher)
    t_lm.require_float("distill as the teacher")
    if s_lm.config.vocab_size != t_lm.config.vocab_size:
        raise WorkbenchError(f"the student's vocabulary ({s_lm.config.vocab_size}) differs from the teacher's "
                             f"({t_lm.config.vocab_size}); distil a model pruned from this teacher")
    n_s, n_t = s_lm.config.num_hidden_layers, t_lm.config.num_hidden_layers
    layer_map = list(cfg.layer_map) if cfg.layer_map is not None else default_layer_map(n_s, n_t)
    if len(layer_map) != n_s or not all(0 <= j < n_t for j in layer_map):
        raise WorkbenchError(f"layer_map must give a teacher layer (0-{n_t - 1}) for each of the student's {n_s} "
                             f"layers, got {layer_map}")
    if cfg.hidden_weight > 0 and s_lm.config.hidden_size != t_lm.config.hidden_size:
        raise WorkbenchError("the hidden-state term needs the same hidden size in student and teacher; set "
                             "hidden_weight to 0")
    head_map = attention_head_map(s_lm, t_lm, layer_map) if cfg.attention_weight > 0 else None
    if plan is not None:
        plan.validate([info.name for info in s_lm.layers])
    data_path = Path(data) if data is not None else demo_text_path("calibration")
    train, val = split_windows(training_windows(s_lm, data_path, cfg.seq_len, training_token_budget(cfg)),
                               cfg.validation_fraction)
    eval_path = Path(eval_text) if eval_text is not None else demo_text_path("heldout")
    eval_ids = text_token_ids(s_lm.tokenizer, eval_path, eval_tokens)  # read no further than the budget
    max_pos = getattr(s_lm.config, "max_position_embeddings", None) or cfg.seq_len
    ctx = min(cfg.seq_len, max_pos, max(2, eval_ids.numel()))

    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    checkpoint = Checkpoint(partial / CHECKPOINT, hash_inputs({
        "student": model_fingerprint(s_lm.model), "teacher": model_fingerprint(t_lm.model),
        "data": file_sha256(data_path), "config": asdict(cfg), "plan": plan.to_dict() if plan else None}))

    teacher_model = t_lm.model
    # the caller's student stays as it was; one loaded here is trained in place (no second copy)
    model = copy.deepcopy(s_lm.model) if isinstance(student, LoadedModel) else s_lm.model
    # logits that are lm_head(final hidden): the loss makes them a chunk of tokens at a time
    plain = check_plain_head(model, eval_ids) and check_plain_head(teacher_model, eval_ids)
    heads = (model.get_output_embeddings(), teacher_model.get_output_embeddings()) if plain else None
    if cfg.attention_weight > 0:  # attention maps come only from the eager implementation
        model.set_attn_implementation("eager")
    attn_before = teacher_model.config._attn_implementation
    with _teacher(teacher_model, eager=cfg.attention_weight > 0):
        if plan is not None:
            fake_quantized(s_lm, model, plan)
        reference = capture_reference(teacher_model, eval_ids, ctx=ctx, progress=False)  # the teacher runs once
        before = evaluate(model, eval_ids, reference=reference, ctx=ctx, progress=False)

        trained, snapshot, restore = _trainable(model, cfg)
        if cfg.gradient_checkpointing:  # one block's activations at a time, not all (0.9 GB at 0.5 B, 256 tokens)
            model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        trainable = [p for p in trained.parameters() if p.requires_grad]
        steps_per_epoch = max(1, len(train) // cfg.batch_size)
        terms_by_step: dict[int, dict] = {}

        def step_loss(idx: torch.Tensor, step: int) -> torch.Tensor:
            batch = train[idx]
            temperature = temperature_at(step, steps_per_epoch, cfg)
            with torch.no_grad():
                t_out = _outputs(teacher_model, batch, cfg, plain)
            with narrow_saved_weights(model):  # 16-bit frozen weights: no float32 copies kept for backward
                s_out = _outputs(model if plain else trained, batch, cfg, plain)
                loss, terms = distillation_loss(s_out, t_out, batch, cfg, temperature, layer_map, head_map,
                                                heads=heads)
            terms_by_step[step] = terms  # this process's steps (a resumed run has only the later ones)
            return loss

        val_teacher: list[torch.Tensor] = []  # the teacher's final hidden states on the held-back windows

        def kl_sum(s, t):
            s = F.log_softmax(s.float() if heads is None else head_logits(heads[0], s), -1)
            t = F.log_softmax(t.float() if heads is None else head_logits(heads[1], t), -1)
            return (float(t.exp().mul_(t.sub_(s)).sum()),)  # in place: three chunk-sized tensors at most

        @torch.no_grad()
        def validation_kl() -> float:
            trained.eval()
            total = count = 0.0
            for k, i in enumerate(range(0, len(val), cfg.batch_size)):
                batch = val[i:i + cfg.batch_size]
                if plain:  # hidden states (the teacher's computed once), the head applied a chunk of tokens at a time
                    if k == len(val_teacher):
                        val_teacher.append(final_hidden(teacher_model, batch)[:, :-1])
                    s, t = final_hidden(model, batch)[:, :-1], val_teacher[k]
                else:
                    s = trained(input_ids=batch, use_cache=False).logits[:, :-1]
                    t = teacher_model(input_ids=batch, use_cache=False).logits[:, :-1]
                rows = s.shape[0] * s.shape[1]
                total += chunked_sum(kl_sum, s.reshape(rows, -1), t.reshape(rows, -1),
                                     chunk=loss_chunk_rows(heads[0].weight.shape[0] if plain else s.shape[-1]))[0]
                count += rows
            trained.train()
            return total / count

        trained.train()
        run = run_training(cfg, n_train=len(train), trainable=trainable, step_loss=step_loss,
                           validation_loss=validation_kl if len(val) else None, snapshot=snapshot, restore=restore,
                           checkpoint=checkpoint, progress=progress, on_step=on_step, desc="distill",
                           what="distillation")
        trained.eval()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_disable()
            model.disable_input_require_grads()
        result = trained.merge_and_unload() if cfg.mode == "lora" else trained
        for p in result.parameters():
            p.requires_grad_(False)
        dtype = source_dtype(s_lm)
        with torch.no_grad():  # rounded to the storage dtype: what is measured is what is saved
            result.to(dtype).to(torch.float32) if stored_dtype(result) == torch.float32 else result.to(dtype)
        enable_float32_compute(result)  # a 16-bit student computes in float32, like the teacher
        after = evaluate(result, eval_ids, reference=reference, ctx=ctx, progress=False)
        del reference
        if cfg.attention_weight > 0:
            result.set_attn_implementation(attn_before)
    if plan is not None:
        _remove_fake_quant(result)
    t_ppl = after.reference_perplexity
    gap = before.perplexity - t_ppl
    report = DistillReport(
        str(out), asdict(cfg), str(t_lm.path), str(s_lm.path), plan.to_dict() if plan else None, len(train),
        sum(p.numel() for p in trainable), run.losses, [terms_by_step.get(i) for i in range(len(run.losses))],
        [temperature_at(i, steps_per_epoch, cfg) for i in range(len(run.losses))],
        run.validation, run.best_step, len(val), t_ppl, _measure(before), _measure(after),
        paired_difference(after, before), paired_difference(after, before, "kl"),
        (before.perplexity - after.perplexity) / gap if gap > 0 else None, int(eval_ids.numel()),
        time.perf_counter() - t0, run.resumed,
        None if cfg.attention_weight <= 0 else "per head" if head_map is not None else "averaged")
    save_model_directory(result, s_lm, partial, dtype)
    if plan is not None:
        plan.save(partial / PLAN_FILE)
    atomic_write_json(partial / REPORT, report.to_dict())
    write_output_manifest(partial, DISTILL_FORMAT, {"source": str(s_lm.path), "teacher": str(t_lm.path)})
    check_output_dir(out, DISTILL_FORMAT)
    swap_into_place(partial, out)
    return report

