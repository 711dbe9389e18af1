"""Float32 arithmetic on a model stored in bfloat16 / float16, one block at a time.

A 4 B model is 8 GB in bfloat16 and 16 GB in float32: holding it in float32 is what stops a 24 GB
machine. Measuring quantization error needs float32 arithmetic, though (bfloat16 rounding of the
activations is larger than the KL of an INT8 model). So weights stay in their stored dtype and
each block's 16-bit parameters are widened to float32 just for its forward pass:

    enable_float32_compute(model)      # load_model does this for 16-bit checkpoints
    model(input_ids=ids).logits        # float32 activations; weights never held twice in float32

Embedding lookups are widened after the lookup (a few rows, not the table). The widened copies
are dropped when the block returns; the parameters themselves are never changed, so the model
stays exactly what was loaded and can be saved, copied or exported as before.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["enable_float32_compute", "disable_float32_compute", "float32_compute_enabled", "compute_units",
           "float32_weight", "stored_dtype", "widened", "widen_", "narrow_", "narrow_saved_weights"]

_HANDLES = "_workbench_float32_handles"
_SAVED = "_workbench_float32_saved"
_NARROW = (torch.float16, torch.bfloat16)


def stored_dtype(model: nn.Module) -> torch.dtype:
    """The dtype most of the model's floating-point parameters are stored in."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def compute_units(model: nn.Module) -> list[nn.Module]:
    """Modules widened as a whole: each decoder block, and every other module owning parameters directly."""
    blocks = []
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and all(hasattr(b, "self_attn") or hasattr(b, "attention")
                                                                for b in mod):
            blocks.extend(mod)
    inside = {id(m) for b in blocks for m in b.modules()}
    units = list(blocks)
    for mod in model.modules():
        if id(mod) in inside or isinstance(mod, nn.Embedding):
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            units.append(mod)
    return units


def widen_(module: nn.Module) -> list:
    """Give every 16-bit parameter of ``module`` a float32 copy as its data; ``narrow_`` puts the originals back."""
    saved = []
    for p in module.parameters():
        if p.dtype in _NARROW:
            saved.append((p, p.data))
            p.data = p.data.to(torch.float32)
    return saved


def narrow_(saved: list) -> None:
    """Undo ``widen_``: the very tensors that were there before (nothing rounded, nothing copied)."""
    for p, data in saved:
        p.data = data


@contextlib.contextmanager
def widened(module: nn.Module):
    """``module`` with float32 parameters for the duration (a search that swaps weights in one block)."""
    saved = widen_(module)
    try:
        yield module
    finally:
        narrow_(saved)


def _widen(module: nn.Module, args) -> None:
    module.__dict__[_SAVED] = widen_(module)
    if args and isinstance(args[0], torch.Tensor) and args[0].dtype in _NARROW:
        return (args[0].to(torch.float32), *args[1:])
    return None


def _narrow(module: nn.Module, args, output):
    narrow_(module.__dict__.pop(_SAVED, []))
    return None


def _widen_output(module: nn.Module, args, output):
    return output.to(torch.float32) if isinstance(output, torch.Tensor) and output.dtype in _NARROW else None


def enable_float32_compute(model: nn.Module) -> nn.Module:
    """Compute ``model`` in float32 whatever its stored dtype (idempotent; no-op on float32 models)."""
    if float32_compute_enabled(model) or stored_dtype(model) not in _NARROW:
        return model
    handles = []
    for unit in compute_units(model):
        handles.append(unit.register_forward_pre_hook(_widen))
        handles.append(unit.register_forward_hook(_narrow, always_call=True))
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            handles.append(mod.register_forward_hook(_widen_output))
    model.__dict__[_HANDLES] = handles
    return model


def disable_float32_compute(model: nn.Module) -> nn.Module:
    """Remove the widening hooks (the model then computes in its stored dtype)."""
    for h in model.__dict__.pop(_HANDLES, []):
        h.remove()
    return model


def float32_compute_enabled(model: nn.Module) -> bool:
    return bool(model.__dict__.get(_HANDLES))


def float32_weight(module: nn.Module) -> torch.Tensor:
    """A layer's weight in float32: dequantized for a quantized layer, widened for a 16-bit one."""
    dequantize = getattr(module, "dequantized_weight", None)
    if dequantize is not None:
        return dequantize()
    return module.weight.detach().to(torch.float32)


@contextlib.contextmanager
def narrow_saved_weights(model: nn.Module):
    """While inside, autograd keeps a widened parameter for backward as the 16-bit parameter itself.

    A block's float32 copies are meant to live for its forward pass only, but a linear layer whose
    input needs a gradient saves its weight (the float32 copy) for backward: over a whole forward
    pass that is a float32 copy of the model held until ``backward()``. Here the saved copy is
    swapped for the parameter, and widened again, one tensor at a time, when backward reads it.
    """
    if not float32_compute_enabled(model):
        yield
        return
    params = [p for p in model.parameters() if p.dtype in _NARROW]

    def pack(t: torch.Tensor):
        if t.dtype == torch.float32 and not t.requires_grad:
            ptr = t.untyped_storage().data_ptr()
            for p in params:
                if p.dtype == torch.float32 and p.untyped_storage().data_ptr() == ptr:  # widened right now
                    return p, t.size(), t.stride(), t.storage_offset()
        return t

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        p, size, stride, offset = saved
        return p.detach().to(torch.float32).as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
