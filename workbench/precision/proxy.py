"""A one-pass sensitivity score: each layer's quantization error weighted by the Fisher information.

Measuring KL costs a forward pass per layer x precision (about 340 of them for Qwen2.5-0.5B, each
dominated by a 151,936-row output layer). To second order, the KL divergence a small weight change
``dW`` adds to the model's next-token distributions is ``1/2 dW^T F dW``, with ``F`` the Fisher
information (the KL's Hessian at the unquantized model). Its diagonal for a linear layer
``y = W x`` is ``F_ij = sum_t g_ti^2 x_tj^2 / T``, where ``g_t`` is the gradient of ``log p(y)``
with ``y`` drawn from the model's own prediction; the score of a precision is then

    1/2 * sum_ij F_ij (W - Q(W))_ij^2        (nats per token: an estimate of the KL, not a measurement)

with ``Q`` the same round-to-nearest quantizer ``quantize_model`` uses. HAWQ, Optimal Brain
Damage and NNCF's Hessian-based mixed precision rank layers by the same quantity. The output layer
uses the exact expectation over the vocabulary, ``p (1 - p)``; the embedding's Fisher is kept
only for the rows the tokens use.

One forward pass records every block's input; the backward pass then runs a block at a time from
the top, recomputing that block from its recorded input with its weights widened to float32 for
that block only. Memory: the model as stored, one block's activations, one layer's Fisher matrix
(the output layer's: vocabulary x hidden float32) and token x vocabulary for ``HEAD_CHUNK`` tokens.

    scores = proxy_scores(lm, ids, ("int8", "int4"))
    scores.damage["model.layers.0.mlp.down_proj"]["int4"]       # estimated KL, nats/token
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..errors import PlanError
from ..evaluation.evaluate import DEFAULT_CTX, strided_windows
from ..model.load import LoadedModel
from ..quantize.plan import DEFAULT_GROUP_SIZE, DEFAULT_SCALE_SEARCH, QuantPlan, fitting_precisions, get_precision
from ..numerics.compute import float32_weight, widened
from ..quantize import layer_quantizer

__all__ = ["ProxyScores", "proxy_scores", "proxy_supported", "decoder_blocks", "spearman", "HEAD_CHUNK",
           "PROXY_SEED", "PROXY_VERSION"]

PROXY_VERSION = 1  # part of cached sweeps' keys: a change to how the score is computed invalidates them

HEAD_CHUNK = 256  # tokens whose vocabulary-wide probabilities are held at once (156 MB at 151,936 tokens)
ROW_CHUNK = 8192  # weight rows quantized at once when scoring (RTN groups never span rows)
PROXY_SEED = 0  # the labels drawn from the model's predictions: the same scores on every run


class _Stop(Exception):
    pass


def decoder_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The decoder blocks of a Llama/Qwen-style model (``model.model.layers``), or None."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    return blocks if isinstance(blocks, nn.ModuleList) and len(blocks) == n else None


def _parts(model: nn.Module):
    """(blocks, final norm, output layer, embedding) of a Llama/Qwen-style model, or None."""
    blocks = decoder_blocks(model)
    norm = getattr(getattr(model, "model", None), "norm", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if blocks is None or not isinstance(norm, nn.Module) or not isinstance(head, nn.Linear) \
            or not isinstance(embed, nn.Embedding):
        return None
    return blocks, norm, head, embed


def proxy_supported(model: nn.Module) -> bool:
    """Whether the proxy can follow this model: decoder blocks, a final norm, a linear output layer."""
    return _parts(model) is not None


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (ties share their average rank)."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # average ranks of ties
            same = x == v
            r[same] = r[same].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class ProxyScores:
    """Estimated KL (nats/token) per layer and precision, and the float model's perplexity on the tokens."""

    damage: dict[str, dict[str, float]]
    tokens: int
    reference_perplexity: float
    seconds: float
    samples: int = 1


@dataclass
class _Group:
    """Equal-length windows run as one batch, with what the passes record for them."""

    ids: torch.Tensor  # [B, S]
    scored: torch.Tensor  # [B, S] bool: positions whose next token is scored
    targets: torch.Tensor  # [B, S] next token ids (0 where not scored)
    inputs: list = field(default_factory=list)  # per block: (hidden, extra args, kwargs)
    last: torch.Tensor | None = None
    grads: list = field(default_factory=list)  # per drawn label set: gradient at the current block's output


def _groups(ids: torch.Tensor, ctx: int) -> list[_Group]:
    windows = strided_windows(len(ids), ctx)
    by_len: dict[int, list] = {}
    for w in windows:
        by_len.setdefault(w.end - w.begin, []).append(w)
    out = []
    for length, ws in by_len.items():
        x = torch.stack([ids[w.begin:w.end] for w in ws])
        scored = torch.zeros(len(ws), length, dtype=torch.bool, device=ids.device)
        targets = torch.zeros(len(ws), length, dtype=torch.long, device=ids.device)
        for k, w in enumerate(ws):
            a, b = w.score_from - w.begin - 1, w.end - w.begin - 1
            scored[k, a:b] = True
            targets[k, a:b] = ids[w.score_from:w.end]
        out.append(_Group(x, scored, targets))
    return out


def _record(model: nn.Module, blocks: nn.ModuleList, head: nn.Module, group: _Group) -> None:
    """One forward pass without gradients: every block's input and the last block's output."""
    def keep_input(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        group.inputs.append((h.detach().to(torch.float32), args[1:], kw))

    def keep_last(module, args, output):
        group.last = _first(output).detach().to(torch.float32)

    def stop(module, args):
        raise _Stop

    handles = [b.register_forward_pre_hook(keep_input, with_kwargs=True) for b in blocks]
    handles.append(blocks[-1].register_forward_hook(keep_last))
    handles.append(head.register_forward_pre_hook(stop, prepend=True))
    try:
        with torch.no_grad():
            model(input_ids=group.ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    if len(group.inputs) != len(blocks) or group.last is None:
        raise PlanError("the proxy score could not follow this model's blocks; use --score kl (score='kl')")


def _weight_error(weight: torch.Tensor, fisher: torch.Tensor, precisions: Sequence[str], settings: QuantPlan,
                  rows: torch.Tensor | None = None) -> dict[str, float]:
    """``1/2 sum F * (W - Q(W))^2`` per precision the weight can take, quantizing ``ROW_CHUNK`` rows at a time.

    ``Q`` is ``quantize_model``'s RTN for a plan with ``settings`` (``layer_quantizer``); groups, two-level
    channel scales and the scale search never span rows, so rows quantized apart round as the whole does.
    """
    precisions = fitting_precisions(precisions, weight.shape[1])  # not the layouts it cannot take
    quantizers = {p: layer_quantizer(settings, p, tuple(weight.shape)) for p in precisions}
    n = len(rows) if rows is not None else weight.shape[0]
    out = {p: 0.0 for p in precisions}
    for a in range(0, n, ROW_CHUNK):
        idx = slice(a, a + ROW_CHUNK)
        w = (weight[rows[idx]] if rows is not None else weight[idx]).detach().to(torch.float32)
        f = fisher[idx]
        for p in precisions:
            err = w - quantizers[p].quantize(w).dequantize()
            out[p] += 0.5 * float((err.square_() * f).sum())
    return out


def _head_pass(norm: nn.Module, head: nn.Linear, groups: Sequence[_Group], samples: int,
               gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """The output layer's Fisher (sum over tokens of p(1 - p) x h^2) and the NLL of the real next tokens.

    Sets each group's ``grads``: the gradient of log p(y), for ``samples`` label sets drawn from
    the model's own predictions, at the last block's output (through the final norm).
    """
    w_head = float32_weight(head)
    b_head = None if head.bias is None else head.bias.detach().to(torch.float32)
    fisher = torch.zeros_like(w_head)
    nll = 0.0
    with torch.enable_grad(), widened(norm):
        for g in groups:
            last = g.last.clone().requires_grad_(True)
            hf = norm(last)
            flat = hf.detach().reshape(-1, hf.shape[-1])
            sel = g.scored.reshape(-1).nonzero().squeeze(1)
            targets = g.targets.reshape(-1)
            grad_hf = torch.zeros(samples, *flat.shape, device=flat.device)
            for chunk in sel.split(HEAD_CHUNK):
                h = flat[chunk]
                logp = torch.log_softmax(F.linear(h, w_head, b_head), dim=-1)
                nll -= float(logp.gather(1, targets[chunk, None]).sum())
                prob = logp.exp_()
                fisher.addmm_(torch.addcmul(prob, prob, prob, value=-1).T, h * h)  # p (1 - p)
                pw = prob @ w_head
                cdf = prob.cumsum_(-1)  # labels drawn by inverse CDF (prob is not needed again)
                for s in range(samples):
                    u = torch.rand(len(chunk), 1, generator=gen).to(cdf.device) * cdf[:, -1:]
                    y = torch.searchsorted(cdf, u).clamp_max_(cdf.shape[1] - 1).squeeze(1)
                    grad_hf[s, chunk] = w_head[y] - pw  # the gradient of log p(y) is onehot(y) - p
            g.grads = [torch.autograd.grad(hf, last, gs.view_as(hf), retain_graph=True)[0] for gs in grad_hf]
            g.last = None
    return fisher, nll


def _block_pass(block: nn.Module, index: int, linears: dict[str, nn.Linear],
                groups: Sequence[_Group]) -> dict[str, torch.Tensor]:
    """Each linear layer's ``sum_t g_t^2 x_t^2`` in one block; moves every group's ``grads`` to the block's input."""
    fishers = {n: torch.zeros(m.weight.shape, device=m.weight.device) for n, m in linears.items()}
    handles = [m.register_forward_hook(_accumulate(fishers[n])) for n, m in linears.items()]
    try:
        with torch.enable_grad(), widened(block):
            for g in groups:
                h, args, kwargs = g.inputs[index]
                x = h.clone().requires_grad_(True)
                out = _first(block(x, *args, **kwargs))
                g.grads = [torch.autograd.grad(out, x, gs, retain_graph=k + 1 < len(g.grads))[0]
                           for k, gs in enumerate(g.grads)]
                g.inputs[index] = None
    finally:
        for hd in handles:
            hd.remove()
    return fishers


def proxy_scores(lm: LoadedModel, ids: torch.Tensor, precisions: Sequence[str] = ("int8", "int4"), *,
                 group_size: int | None = DEFAULT_GROUP_SIZE, symmetric: bool = True,
                 scale_search: bool = DEFAULT_SCALE_SEARCH, ctx: int | None = None, samples: int = 1,
                 seed: int = PROXY_SEED, progress: bool = True, full_range: bool = False) -> ProxyScores:
    """Estimated KL of every quantizable layer alone at each precision, from one forward and one backward pass.

    ``samples`` label sets are drawn per position for the blocks' Fisher (more: less noise, one
    more backward pass each).
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    settings = QuantPlan(default=None, group_size=group_size, symmetric=symmetric, scale_search=scale_search,
                         full_range=full_range)
    for p in precisions:  # a float or unsupported precision fails here, before the passes
        prec = get_precision(p)
        if layer_quantizer(settings, p, (1, (prec.super_block or prec.group_size or 1) if prec else 1)) is None:
            raise PlanError(f"the proxy scores integer precisions, not '{p}'")
    model = lm.model
    parts = _parts(model)
    if parts is None:
        raise PlanError("the proxy score needs a Llama/Qwen-style model (model.layers, model.norm, a linear "
                        "output layer); use --score kl (score='kl')")
    blocks, norm, head, embed = parts
    names = {id(m): n for n, m in model.named_modules()}
    known = {info.name for info in lm.layers}
    max_pos = getattr(lm.config, "max_position_embeddings", None) or DEFAULT_CTX
    ids = ids.reshape(-1).long().to(next(model.parameters()).device)  # every group's tensors live beside the model
    groups = _groups(ids, min(ctx or DEFAULT_CTX, max_pos, len(ids)))
    n_scored = int(sum(g.scored.sum() for g in groups))
    gen = torch.Generator().manual_seed(seed)
    damage: dict[str, dict[str, float]] = {}

    def score(name: str, weight: torch.Tensor, fisher: torch.Tensor, draws: int, rows=None) -> None:
        if name in known:
            damage[name] = _weight_error(weight, fisher.div_(n_scored * draws), precisions, settings, rows)

    with tqdm(total=len(groups) + 1 + len(blocks), desc="proxy score", unit="step",
              disable=not progress, leave=False) as bar:
        for g in groups:
            _record(model, blocks, head, g)
            bar.update(1)
        fisher, nll = _head_pass(norm, head, groups, samples, gen)
        score(names[id(head)], head.weight, fisher, 1)  # the exact expectation: no draws to average
        del fisher
        bar.update(1)
        for i in reversed(range(len(blocks))):  # from the top, each block recomputed from its recorded input
            linears = {names[id(m)]: m for m in blocks[i].modules() if isinstance(m, nn.Linear)}
            for n, f in _block_pass(blocks[i], i, linears, groups).items():
                score(n, linears[n].weight, f, samples)
            bar.update(1)
        # the gradient at block 0's input is the embedding output's (Llama/Qwen); only the rows used have Fisher
        rows, inverse = torch.unique(torch.cat([g.ids.reshape(-1) for g in groups]), return_inverse=True)
        g2 = torch.cat([sum(gs.square() for gs in g.grads).reshape(-1, g.grads[0].shape[-1]) for g in groups])
        score(names[id(embed)], embed.weight, torch.zeros(len(rows), g2.shape[1], device=g2.device).index_add_(0, inverse, g2),
              samples, rows)
    ordered = {info.name: damage[info.name] for info in lm.layers if info.name in damage}
    return ProxyScores(ordered, n_scored, math.exp(nll / n_scored), time.perf_counter() - t0, samples)


def _accumulate(fisher: torch.Tensor):
    """Forward hook on a linear layer: adds ``sum_t g_t^2 x_t^2`` to ``fisher`` when its output's gradient arrives."""
    def hook(module, args, output):
        x2 = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32).square()

        def on_grad(grad):
            fisher.addmm_(grad.reshape(-1, grad.shape[-1]).to(torch.float32).square().T, x2)
        output.register_hook(on_grad)
    return hook
