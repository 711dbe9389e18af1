"""LoRA fine-tuning before quantization: adapt the model to the user's text, merge, save a model directory.

    report = finetune_lora("demo", "my_domain.jsonl", "out/tuned", FinetuneConfig(steps=200))
    report.perplexity_before, report.perplexity_after    # on the held-out text, same windows
    lm = load_model("out/tuned")                         # a plain Hugging Face directory again

Low-rank adapters (peft) are trained on the attention and MLP projections while the base weights
stay frozen; at the end they are merged into the weights, so every later step (calibrate,
quantize, export) sees an ordinary model. Training text is read like calibration text (plain
text, JSONL ``text``, Alpaca), tokenized as one stream and cut into ``seq_len`` windows.

Batches are a function of (seed, step) alone and dropout is off by default, so a run is
reproducible, and a checkpoint (adapters, optimizer, step, losses) written atomically every
``checkpoint_every`` steps lets an interrupted run resume where it stopped with the same result.
The output directory appears only when complete (written beside it, then renamed).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..assets import demo_text_path
from ..evaluation.data import MIN_POOL_TOKENS, iter_records
from ..errors import DataError, WorkbenchError
from ..evaluation.evaluate import evaluate
from ..evaluation.textio import ReadExtent, text_token_ids, tokenize_bounded
from ..model.load import LoadedModel, load_model
from ..files.workspace import (atomic_write_json, check_output_dir, file_sha256, hash_inputs, model_fingerprint,
                        swap_into_place, write_output_manifest)
from ..numerics.compute import stored_dtype

__all__ = ["FinetuneConfig", "FinetuneReport", "finetune_lora", "training_windows", "DEFAULT_TARGETS", "run_training",
           "TrainingRun", "save_model_directory", "source_dtype"]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT = "checkpoint.pt"
FORMAT = "workbench-finetune"  # the kind named in the manifest of a fine-tuned --out
REPORT = "finetune.json"


@dataclass(frozen=True)
class FinetuneConfig:
    """What a run does; every field is part of the checkpoint key (a changed setting starts afresh)."""

    steps: int = 200
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0
    lr: float = 1e-3
    warmup: int = 10
    batch_size: int = 8
    seq_len: int = 256
    seed: int = 0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    checkpoint_every: int = 25
    validation_fraction: float = 0.1  # training windows held back to pick the best step (0: keep the last step)
    eval_every: int = 25  # steps between validation measurements

    def validate(self) -> None:
        for name in ("steps", "rank", "alpha", "batch_size", "seq_len", "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise WorkbenchError(f"fine-tuning: {name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise WorkbenchError(f"fine-tuning: dropout must be in [0, 1), got {self.dropout}")
        if not self.lr > 0:
            raise WorkbenchError(f"fine-tuning: lr must be positive, got {self.lr}")
        if not 0 <= self.validation_fraction < 1:
            raise WorkbenchError(f"fine-tuning: validation_fraction must be in [0, 1), got {self.validation_fraction}")


@dataclass
class FinetuneReport:
    """Losses per step, held-out perplexity before and after, and where the merged model went."""

    out_dir: str
    config: dict
    train_windows: int
    train_tokens: int
    trainable_parameters: int
    total_parameters: int
    losses: list[float] = field(default_factory=list)  # training loss per step (mean over the batch)
    validation: list[tuple[int, float]] = field(default_factory=list)  # (step, loss on held-back windows)
    best_step: int | None = None  # the step whose adapters were merged (the lowest validation loss)
    validation_windows: int = 0
    perplexity_before: float | None = None
    perplexity_after: float | None = None
    eval_tokens: int = 0
    seconds: float = 0.0
    resumed_from_step: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        ppl = ""
        if self.perplexity_before is not None and self.perplexity_after is not None:
            change = self.perplexity_after / self.perplexity_before - 1
            ppl = (f"; held-out perplexity {self.perplexity_before:.2f} -> {self.perplexity_after:.2f} "
                   f"({change:+.1%}, {self.eval_tokens:,} tokens)")
        chosen = ""
        if self.validation:
            chosen = (f", merged step {self.best_step} (lowest loss on {self.validation_windows} held-back windows"
                      f"{', i.e. the model unchanged' if self.best_step == 0 else ''})")
        return (f"LoRA r={self.config['rank']} on {len(self.config['target_modules'])} projection kinds, "
                f"{self.trainable_parameters:,} trainable of {self.total_parameters:,}; {len(self.losses)} steps "
                f"on {self.train_windows} windows of {self.config['seq_len']} tokens, loss "
                f"{self.losses[0]:.3f} -> {self.losses[-1]:.3f}{chosen}{ppl}; {self.seconds:.0f} s -> {self.out_dir}")


def training_token_budget(cfg) -> int:
    """Tokens a run can use: every window its steps draw (plus the held-back share), at least ``MIN_POOL_TOKENS``."""
    windows = cfg.steps * cfg.batch_size / (1 - getattr(cfg, "validation_fraction", 0.0))
    return max(MIN_POOL_TOKENS, int(windows + 1) * cfg.seq_len)


def training_windows(lm: LoadedModel, data: str | Path, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """The training text as ``[n, seq_len]`` token windows (documents joined by the end-of-text token).

    The file is read a record (a plain text: a bounded piece) at a time, and no further than
    ``max_tokens``; a partial read is said as a note on the ``workbench`` logger.
    """
    extent = ReadExtent(str(data))
    fmt, records = iter_records(data, kind="training", extent=extent)
    eos = lm.tokenizer.eos_token_id
    pieces, n = [], 0
    for rec in records:
        if fmt != "text" and not rec.text.strip():
            raise DataError(f"training file '{data}': {rec.where} is empty: give a text with at least a few sentences")
        ids = torch.tensor(tokenize_bounded(lm.tokenizer, rec.text, max_tokens=max_tokens), dtype=torch.long)
        pieces.append(ids)
        n += len(ids)
        if eos is not None and fmt != "text":  # plain text is one document in pieces
            pieces.append(torch.tensor([eos], dtype=ids.dtype))
        if max_tokens is not None and n >= max_tokens:
            break
    if fmt == "text" and eos is not None:
        pieces.append(torch.tensor([eos], dtype=torch.long))
    note = extent.note(f"enough for {max_tokens:,} training tokens" if max_tokens else "")
    if note:
        logging.getLogger("workbench").info(note)
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    n = stream.numel() // seq_len
    if n < 1:
        raise DataError(f"training file '{data}' has {stream.numel()} tokens, fewer than one window of {seq_len}; "
                        "give more text or a smaller --seq-len")
    return stream[: n * seq_len].view(n, seq_len).long()


def _batch(n: int, step: int, cfg: FinetuneConfig) -> torch.Tensor:
    """Window indices for ``step``: epochs of a seeded permutation, so a batch depends on (seed, step) only."""
    per_epoch = max(1, n // cfg.batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))
    if n < cfg.batch_size:
        return perm
    return perm[i * cfg.batch_size:(i + 1) * cfg.batch_size]


def _lr_at(step: int, cfg: FinetuneConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _heldout_perplexity(model, ids: torch.Tensor, ctx: int) -> float:
    return evaluate(model, ids, ctx=ctx, progress=False).perplexity


def split_windows(windows: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation windows: the last ``fraction`` of the text held back as one block.

    A contiguous block, not every k-th window: neighbouring windows share their documents, so an
    interleaved split would reward memorising them instead of showing the overfitting.
    """
    n = len(windows)
    n_val = int(round(n * fraction)) if fraction > 0 and n >= 2 else 0
    if n_val == 0:
        return windows, windows[:0]
    return windows[: n - n_val], windows[n - n_val:]


@torch.no_grad()
def _validation_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy over the held-back windows (dropout off)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        total += float(model(input_ids=batch, labels=batch, use_cache=False).loss) * len(batch)
        count += len(batch)
    model.train(was_training)
    return total / count


class Checkpoint:
    """Adapters, optimizer, losses and the best adapters so far, in one file replaced atomically."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key

    def load(self) -> dict | None:
        if not self.path.is_file():
            return None
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        # another model, data or config (or an older checkpoint layout): start afresh
        return state if state.get("key") == self.key and "weights" in state else None

    def save(self, **state) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({"key": self.key, **state}, tmp)
        tmp.replace(self.path)


@dataclass
class TrainingRun:
    """What ``run_training`` did: losses per step, validation losses, the step kept, where it resumed."""

    losses: list[float]
    validation: list[tuple[int, float]]
    best_step: int
    resumed: int | None


def run_training(cfg, *, n_train: int, trainable: list, step_loss: Callable[[torch.Tensor, int], torch.Tensor],
                 validation_loss: Callable[[], float] | None, snapshot: Callable[[], dict],
                 restore: Callable[[dict], None], checkpoint: "Checkpoint", progress: bool = True,
                 on_step: Callable[[int, float], None] | None = None, desc: str = "train",
                 what: str = "training") -> TrainingRun:
    """The one training loop (fine-tuning, distillation): AdamW, warm-up then cosine, resumable, best step kept.

    ``cfg`` carries steps, lr, warmup, batch_size, seed, checkpoint_every and eval_every. Each step
    takes the batch of window indices ``_batch`` draws for (seed, step) and minimises
    ``step_loss(indices, step)``. ``validation_loss()`` runs at step 0, every ``eval_every`` steps
    and at the end; the weights ``snapshot()`` returns at the lowest one are ``restore``d at the
    end (without validation, the last step's). A checkpoint (weights, optimizer, losses, best)
    every ``checkpoint_every`` steps lets an interrupted run continue to the same result.
    """
    from tqdm.auto import tqdm
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    start, losses, validation, resumed, best = 0, [], [], None, None
    state = checkpoint.load()
    if state is not None:
        restore(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        start = resumed = int(state["step"])
        losses, validation = list(state["losses"]), [tuple(v) for v in state["validation"]]
        if state.get("best_weights") is not None:
            best = (int(state["best_step"]), float(state["best_loss"]), state["best_weights"])

    def validate(step: int) -> None:
        nonlocal best
        if validation_loss is not None:
            validation.append((step, float(validation_loss())))
            if best is None or validation[-1][1] < best[1]:
                best = (step, validation[-1][1], snapshot())

    if start == 0:
        validate(0)  # the model as it came: training must beat it to be chosen
    bar = tqdm(range(start, cfg.steps), desc=desc, unit="step", disable=not progress, leave=False,
               initial=start, total=cfg.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss = step_loss(_batch(n_train, step, cfg), step)
        if not torch.isfinite(loss):
            raise WorkbenchError(f"{what} diverged at step {step} (loss {loss.item()}); lower lr "
                                 f"(now {cfg.lr}) and run again")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            validate(done)
        if on_step is not None:
            on_step(done, losses[-1])
        if done % cfg.checkpoint_every == 0 and done < cfg.steps:
            checkpoint.save(step=done, losses=losses, validation=validation, weights=snapshot(),
                            optimizer=optimizer.state_dict(), best_step=best[0] if best else None,
                            best_loss=best[1] if best else None, best_weights=best[2] if best else None)
    best_step = cfg.steps
    if best is not None:
        best_step = best[0]
        restore(best[2])
    return TrainingRun(losses, validation, best_step, resumed)


def finetune_lora(model: str | Path | LoadedModel = "demo", data: str | Path | None = None,
                  out_dir: str | Path = "out/finetuned", config: FinetuneConfig | None = None, *,
                  eval_text: str | Path | None = None, eval_tokens: int = 4096, overwrite: bool = False,
                  progress: bool = True, on_step: Callable[[int, float], None] | None = None) -> FinetuneReport:
    """Train LoRA adapters on ``data`` (default: the demo model's calibration text), merge them, save.

    A fraction of the training windows is held back; the adapters of the step with the lowest loss
    on them are the ones merged (small data overfits fast). ``out_dir`` receives an ordinary model
    directory (safetensors, config, tokenizer) and ``finetune.json``. Work in progress lives in
    ``<out_dir>.partial/``; running again with the same model, data and config resumes from its last
    checkpoint. ``on_step(step, loss)`` reports progress. Held-out perplexity before and after is
    measured on ``eval_text`` (default: the bundled held-out text), never used for choosing.
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    cfg = config or FinetuneConfig()
    cfg.validate()
    out = check_output_dir(out_dir, FORMAT)  # anything but an earlier fine-tuned model is refused, never deleted
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise WorkbenchError(f"--out '{out}' holds an earlier fine-tuned model; pass --overwrite (overwrite=True) to "
                             "replace it, or choose another --out")
    t0 = time.perf_counter()
    lm = model if isinstance(model, LoadedModel) else load_model(model, dtype="float32")
    lm.require_float("finetune")  # LoRA merges into float weights: train the float model it was made from
    data_path = Path(data) if data is not None else demo_text_path("calibration")
    train, val = split_windows(training_windows(lm, data_path, cfg.seq_len, training_token_budget(cfg)),
                               cfg.validation_fraction)
    eval_path = Path(eval_text) if eval_text is not None else demo_text_path("heldout")
    eval_ids = text_token_ids(lm.tokenizer, eval_path, eval_tokens)  # read no further than the budget
    max_pos = getattr(lm.model.config, "max_position_embeddings", None) or cfg.seq_len
    ctx = min(cfg.seq_len, max_pos, max(2, eval_ids.numel()))

    present = {name.rsplit(".", 1)[-1] for name, mod in lm.model.named_modules() if isinstance(mod, torch.nn.Linear)}
    targets = [t for t in cfg.target_modules if t in present]
    if not targets:
        raise WorkbenchError(f"none of the LoRA target modules {list(cfg.target_modules)} is a linear layer of this "
                             f"model (its linear layers end in: {', '.join(sorted(present))})")
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    checkpoint = Checkpoint(partial / CHECKPOINT, hash_inputs({
        "model": str(lm.path), "weights": model_fingerprint(lm.model), "data": file_sha256(data_path),
        "config": asdict(cfg)}))

    base = copy.deepcopy(lm.model)  # the caller's model stays as it was
    ppl_before = _heldout_perplexity(base, eval_ids, ctx)
    torch.manual_seed(cfg.seed)  # LoRA's A matrices start random: seeded, so a run is reproducible
    peft_model = get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                 target_modules=targets, bias="none", task_type="CAUSAL_LM"))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]

    def restore(adapters: dict) -> None:
        set_peft_model_state_dict(peft_model, adapters)

    def step_loss(batch_idx: torch.Tensor, step: int) -> torch.Tensor:
        batch = train[batch_idx]
        return peft_model(input_ids=batch, labels=batch, use_cache=False).loss

    peft_model.train()
    run = run_training(cfg, n_train=len(train), trainable=trainable, step_loss=step_loss,
                       validation_loss=(lambda: _validation_loss(peft_model, val, cfg.batch_size)) if len(val)
                       else None,
                       snapshot=lambda: {k: v.detach().clone()
                                         for k, v in get_peft_model_state_dict(peft_model).items()},
                       restore=restore, checkpoint=checkpoint, progress=progress, on_step=on_step, desc="fine-tune",
                       what="fine-tuning")
    losses, validation, best_step, resumed = run.losses, run.validation, run.best_step, run.resumed
    peft_model.eval()
    merged = peft_model.merge_and_unload()
    dtype = source_dtype(lm)
    merged.to(dtype).to(torch.float32)  # round to the storage dtype first: what is measured is what is saved
    ppl_after = _heldout_perplexity(merged, eval_ids, ctx)
    report = FinetuneReport(str(out), {**asdict(cfg), "target_modules": targets}, len(train), train.numel(),
                            sum(p.numel() for p in trainable), lm.parameters, losses, validation, best_step,
                            len(val), ppl_before, ppl_after, int(eval_ids.numel()), time.perf_counter() - t0, resumed)
    save_model_directory(merged, lm, partial, dtype)
    atomic_write_json(partial / REPORT, report.to_dict())
    write_output_manifest(partial, FORMAT, {"source": str(lm.path)})
    check_output_dir(out, FORMAT)  # still an earlier fine-tuned model (or nothing) after the training
    swap_into_place(partial, out)
    return report


def save_model_directory(model, lm: LoadedModel, directory: Path, dtype: torch.dtype | None = None) -> None:
    """Save a model in the source's storage dtype (fp16 stays fp16) with the source's tokenizer.

    The model is put back in the dtype it had (a 16-bit model is not widened to a float32 copy); a
    leftover training checkpoint is removed.
    """
    dtype, before = dtype or source_dtype(lm), stored_dtype(model)
    model.to(dtype)
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        model.to(before)
    lm.tokenizer.save_pretrained(directory)
    (Path(directory) / CHECKPOINT).unlink(missing_ok=True)


def source_dtype(lm: LoadedModel) -> torch.dtype:
    """The dtype the source model is stored in (its config's dtype), float32 when it says none."""
    config = json.loads((lm.path / "config.json").read_text(encoding="utf-8"))
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, torch.float32)
