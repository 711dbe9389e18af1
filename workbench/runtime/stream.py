"""The one token loop every runtime runs through: ``stream_tokens``, with greedy or seeded ``Sampling``.

    for token in stream_tokens(runner, prompt_ids, 64, sampling=Sampling(0.8, top_k=40), eos_ids=(2,)):
        ...

``runner`` is a PyTorch causal LM (its KV cache in a ``DynamicCache``), a graph runner with
``run_prefill`` / ``run_decode`` and a compact KV cache (``OnnxCausalLM``, ``MnnCausalLM``), or a
runtime that hands out its own steps (``steps()``: onnxruntime-genai's generator). Tokens per second
count the tokens after the first over the time spent computing them; prefill is timed apart.
``torch_threads`` sets how many threads PyTorch computes on meanwhile.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

__all__ = ["Sampling", "GenerationStats", "stream_tokens", "torch_threads", "STOP_WORDS"]


@contextlib.contextmanager
def torch_threads(threads: int | None = 1):
    """PyTorch on ``threads`` threads inside (None: unchanged). Decode-sized matmuls are fastest on one
    thread; more threads oversubscribe a busy CPU badly."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# why a generation stopped, in words (``stop_reason``'s codes stay in the JSON)
STOP_WORDS = {"max_new_tokens": "reached the token limit (max tokens)", "eos": "the model ended its answer",
              "context": "the model's context is full"}


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy (argmax); above 0 a seeded draw from the
    ``top_k`` most likely tokens (all of them when ``top_k`` is None)."""

    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or None for the whole vocabulary), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def picker(self) -> Callable[[np.ndarray], int]:
        """A function from one position's logits to a token id (with its own seeded generator)."""
        if self.greedy:
            return lambda logits: int(np.argmax(logits))
        rng = np.random.default_rng(self.seed)

        def pick(logits: np.ndarray) -> int:
            z = np.asarray(logits, np.float64).reshape(-1) / self.temperature
            if self.top_k is not None and self.top_k < z.size:
                keep = np.argpartition(z, -self.top_k)[-self.top_k:]
            else:
                keep = np.arange(z.size)
            p = np.exp(z[keep] - z[keep].max())
            return int(keep[rng.choice(keep.size, p=p / p.sum())])
        return pick


@dataclass
class GenerationStats:
    """How one generation went: prompt length, tokens made, prefill time, decode time, why it stopped."""

    prompt_tokens: int
    new_tokens: int = 0
    prefill_seconds: float = 0.0  # the prompt through the model, up to the first new token
    decode_seconds: float = 0.0  # computing every token after the first
    stop_reason: str | None = None  # "eos", "max_new_tokens", "context" (the model's positions are used up)

    @property
    def tokens_per_second(self) -> float | None:
        """Decode speed: tokens after the first over the time spent computing them (None before a second)."""
        if self.new_tokens < 2 or self.decode_seconds <= 0:
            return None
        return (self.new_tokens - 1) / self.decode_seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    def summary(self) -> str:
        tps = self.tokens_per_second
        speed = f"{tps:,.1f} tok/s" if tps is not None else "- tok/s"
        stop = f"; stopped: {STOP_WORDS.get(self.stop_reason, self.stop_reason)}" if self.stop_reason else ""
        return (f"{self.new_tokens} tokens, {speed} after the first; prefill {self.prompt_tokens} tokens "
                f"{self.prefill_seconds * 1000:,.1f} ms{stop}")


class _TorchSteps:
    """A PyTorch causal LM, its KV cache in a ``DynamicCache``; logits of the last position only."""

    def __init__(self, model, threads: int | None):
        self.model, self.cache, self.threads = model, None, threads
        self.device = next(model.parameters()).device

    def _run(self, ids: list[int]) -> np.ndarray:
        import torch

        with torch.inference_mode(), torch_threads(self.threads):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[0, -1].float().cpu().numpy()

    def start(self, prompt: list[int]) -> np.ndarray:
        from transformers import DynamicCache
        self.cache = DynamicCache()
        return self._run(prompt)

    def step(self, token: int, position: int) -> np.ndarray:
        return self._run([token])


class _GraphSteps:
    """A runner with ``run_prefill`` / ``run_decode`` (``OnnxCausalLM``, ``MnnCausalLM``) and its compact KV cache."""

    def __init__(self, runner):
        self.runner, self.kv = runner, None

    def start(self, prompt: list[int]) -> np.ndarray:
        last, _, self.kv = self.runner.run_prefill(prompt)
        return last

    def step(self, token: int, position: int) -> np.ndarray:
        last, self.kv, _ = self.runner.run_decode(token, self.kv, position)
        return last


def _graph_positions(runner) -> int | None:
    """Positions a static decode graph can hold: its past plus the token it takes."""
    past = getattr(runner, "static_past", None)
    return past + 1 if past is not None else None


def _timed(steps, compute, pick) -> tuple[int, float]:
    """The token ``pick`` draws from ``compute()`` and the seconds both took. A runtime in a child process
    (``engine_seconds`` on its steps) times its own call there, so the pipe to it is not counted as compute."""
    t = time.perf_counter()
    logits = compute()
    mid = time.perf_counter()
    token = pick(logits)
    own = getattr(steps, "engine_seconds", None)
    return token, (mid - t if own is None else own) + time.perf_counter() - mid


def stream_tokens(runner, prompt: Sequence[int], max_new_tokens: int, *, sampling: Sampling | None = None,
                  eos_ids: Sequence[int] = (), max_positions: int | None = None, threads: int | None = None,
                  stats: GenerationStats | None = None) -> Iterator[int]:
    """Token ids continuing ``prompt``, one at a time, until an ``eos_ids`` token (yielded), ``max_new_tokens``,
    or ``max_positions`` fed tokens. ``runner``: a PyTorch model (run on ``threads`` threads; None keeps
    torch's setting), or an object with ``run_prefill`` and ``run_decode``. Nothing runs ahead of the
    caller: the next step is computed when it is asked for. Timings and the stop reason go to ``stats``."""
    prompt = [int(t) for t in prompt]
    stats = stats if stats is not None else GenerationStats(len(prompt))
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
    if max_new_tokens == 0:
        stats.stop_reason = "max_new_tokens"
        return
    if hasattr(runner, "steps"):  # a runtime that keeps its own state (onnxruntime-genai's generator)
        steps = runner.steps(len(prompt) + max_new_tokens)
    else:
        steps = _GraphSteps(runner) if hasattr(runner, "run_prefill") else _TorchSteps(runner, threads)
    limits = [n for n in (max_positions, _graph_positions(runner)) if n is not None]
    limit = min(limits) if limits else None
    if limit is not None and len(prompt) > limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens, more than the model's {limit} positions: shorten it")
    pick, eos = (sampling or Sampling()).picker(), {int(t) for t in eos_ids}
    token, stats.prefill_seconds = _timed(steps, lambda: steps.start(prompt), pick)
    fed = len(prompt)
    while True:
        stats.new_tokens += 1
        yield token
        if token in eos:
            stats.stop_reason = "eos"
            return
        if stats.new_tokens >= max_new_tokens:
            stats.stop_reason = "max_new_tokens"
            return
        if limit is not None and fed >= limit:
            stats.stop_reason = "context"
            return
        token, spent = _timed(steps, lambda: steps.step(token, fed), pick)
        stats.decode_seconds += spent
        fed += 1
