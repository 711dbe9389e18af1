"""Cross-check of the workbench's AWQ against autoawq 0.2.9, where that package imports.

autoawq is deprecated upstream and installed without its dependencies (``pip install --no-deps
autoawq==0.2.9``). On CPU its scale search keeps its "original" weights with ``.cpu()``, which on a
CPU tensor is the same tensor, so the search overwrites them; :func:`patched_autoawq` recompiles
that one method with a real copy for the duration of a ``with`` block. The comparison rounds
autoawq's scaled and clipped float weights with the workbench's own quantizer, so only the
searches differ.

    with patched_autoawq() as AutoAWQ:
        kl = compare_with_autoawq(lm, texts, AutoAWQ, group_size=128)
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import sys
import textwrap
import types

import torch

from ..errors import WorkbenchError
from ..assets import demo_text_path
from ..evaluation.evaluate import encode_text, evaluate, read_text
from .plan import QuantPlan
from .rtn import fake_quantize

__all__ = ["AutoAwqUnavailable", "patched_autoawq", "compare_with_autoawq", "calibration_texts"]


class AutoAwqUnavailable(WorkbenchError):
    """autoawq cannot run here (not installed, an import failure, or a version the patch does not fit)."""


@contextlib.contextmanager
def patched_autoawq():
    """``AutoAWQForCausalLM`` with its CPU aliasing fixed; the patch is undone on exit."""
    stubbed = False
    if "datasets" not in sys.modules:
        try:
            importlib.import_module("datasets")
        except ImportError:  # only autoawq's hub loaders use it; calibration texts are passed directly
            stub = types.ModuleType("datasets")
            stub.load_dataset = None
            sys.modules["datasets"] = stub
            stubbed = True
    try:
        try:
            qz = importlib.import_module("awq.quantize.quantizer")
            from awq import AutoAWQForCausalLM
        except Exception as e:  # noqa: BLE001 - any import failure means the cross-check cannot run
            raise AutoAwqUnavailable(f"autoawq cannot be imported here ({type(e).__name__}: {e}); install it with "
                                     "`pip install --no-deps autoawq==0.2.9`") from None
        original = qz.AwqQuantizer._compute_best_scale
        src = textwrap.dedent(inspect.getsource(original))
        if "v.cpu()" not in src:
            raise AutoAwqUnavailable("autoawq's scale search changed; the aliasing patch no longer applies "
                                     "(the cross-check is written for autoawq 0.2.9)")
        namespace: dict = {}
        exec(compile(src.replace("v.cpu()", "v.detach().clone()"), qz.__file__, "exec"), vars(qz), namespace)
        qz.AwqQuantizer._compute_best_scale = namespace["_compute_best_scale"]
        try:
            yield AutoAWQForCausalLM
        finally:
            qz.AwqQuantizer._compute_best_scale = original
    finally:
        if stubbed:
            sys.modules.pop("datasets", None)


def calibration_texts(text: str, count: int, min_chars: int = 300) -> list[str]:
    """Up to ``count`` samples of whole lines of ``text``, each at least ``min_chars`` long (autoawq takes text)."""
    chunks, cur = [], ""
    for line in text.split("\n"):
        if not line.strip():
            continue
        cur += line + "\n"
        if len(cur) > min_chars:
            chunks.append(cur)
            cur = ""
            if len(chunks) == count:
                break
    return chunks


def compare_with_autoawq(lm, texts: list[str], auto_awq, *, group_size: int = 128, bits: int = 4,
                         seq_len: int = 512, eval_ids: list[int] | None = None, ctx: int = 512) -> dict[str, float]:
    """KL divergence to ``lm`` of RTN, the workbench's AWQ and autoawq's AWQ, on the same calibration texts.

    ``texts`` are calibration samples (each cut to ``seq_len`` tokens for both searches); asymmetric
    ``bits``-bit weights in groups of ``group_size``, as autoawq's GEMM format. ``eval_ids``
    defaults to the bundled held-out text.
    """
    from .model import quantize_model
    if not texts:
        raise WorkbenchError("the AWQ cross-check needs at least one calibration text")
    aw = auto_awq.from_pretrained(str(lm.path), torch_dtype=torch.float32, device_map="cpu")
    aw.quantize(lm.tokenizer, quant_config={"zero_point": True, "q_group_size": group_size, "w_bit": bits,
                                            "version": "GEMM"},
                calib_data=list(texts), max_calib_samples=len(texts), max_calib_seq_len=seq_len,
                export_compatible=True)
    theirs = aw.model.float().eval()
    names = [i.name for i in lm.layers if ".layers." in i.name]
    with torch.no_grad():
        for n in names:  # their scaled and clipped float weights, rounded by the workbench's quantizer
            mod = theirs.get_submodule(n)
            mod.weight.data = fake_quantize(mod.weight.data.float(), bits, group_size, False)
    plan = QuantPlan.uniform(f"int{bits}", group_size=group_size, symmetric=False)
    samples = [torch.as_tensor(encode_text(lm.tokenizer, t)[:seq_len]) for t in texts]
    ours = quantize_model(lm, plan, method="awq", calibration=samples, progress=False)
    rtn = quantize_model(lm, plan, progress=False)
    if eval_ids is None:
        eval_ids = encode_text(lm.tokenizer, read_text(demo_text_path("heldout")))
    models = {"rtn": rtn.apply_(copy.deepcopy(lm.model)), "ours": ours.apply_(copy.deepcopy(lm.model)),
              "autoawq": theirs}
    return {name: evaluate(m, eval_ids, ctx=ctx, reference=lm.model, progress=False).kl_divergence
            for name, m in models.items()}
