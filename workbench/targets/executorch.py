"""ExecuTorch, ``executorch``: the plan's model as one ``.pte`` program for ExecuTorch's XNNPACK backend, holding
the plan's own integer codes, run and timed by ExecuTorch's runtime here.

    convert("demo", "executorch", "out/et", bits=4)        # model.pte, tokenizer files, conversion.json
    lm = ExecuTorchLM("out/et"); lm.logits(ids); lm.run_prefill(prompt); lm.run_decode(token, None, pos)
    pte_weights("out/et/model.pte")                         # every constant buffer in the program, by key

The program is the workbench's own decoder written as a PyTorch module (``EtDecoder``) and lowered with
``torch.export`` and ExecuTorch's XNNPACK partitioner. Each quantized linear layer is the pattern XNNPACK's
dynamically quantized fully-connected op takes: activations quantized to int8 per token at run time
(``choose_qparams_per_token_asymmetric``), the weight ``dequantize_per_channel(_group)`` of the plan's codes
and scales; XNNPACK stores those codes as they are (4-bit codes packed two to a byte, offset by 8). The KV
cache is a mutable buffer of the program, written at the positions each call is given, so one method
(``forward(tokens, positions)``) serves prefill and decode and the runtime keeps the cache between calls.

Layouts it carries (``carried_layout``): symmetric int4 codes with one scale per group of a multiple of 32
columns, or per channel; symmetric int8 codes per channel. XNNPACK holds a grouped layer's scales as
bfloat16 (the plan's are float16 values): the codes are the plan's, each group's scale is rounded to 8
significant bits. Grouped int8, asymmetric codes (zero points), minimums and two-level scales have no
XNNPACK layout and are refused by layer. Float layers (the embedding, a float output layer) stay float32.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ModelLoadError, PlanError, WorkbenchError
from .common import native_output_to, score_in_runtime
from .registry import Target, register_target
from ..files.folder_paths import folder_file
from ..numerics.memory import reset_peak_rss, rss_mb, settled_rss_mb
from ..onnx.build import DecoderSpec

__all__ = ["EtDecoder", "carried_layout", "export_pte", "pte_weights", "plan_weight_bytes", "check_pte_codes",
           "ExecuTorchLM", "open_executorch", "convert_executorch", "TARGET", "FILES", "INSTALL", "PTE_FILE"]

PTE_FILE = "model.pte"
FILES = (PTE_FILE,)  # the tokenizer files beside it are the model's own, whichever it has
INSTALL = ("pip install --no-deps executorch==1.5.1 torchao==0.18.0 ruamel.yaml==0.19.1 tabulate==0.10.0 "
           "(or `make install`)")
GROUP_MULTIPLE = 32  # XNNPACK's blockwise 4-bit kernels take groups of a multiple of 32 columns


def _import_executorch():
    """ExecuTorch's exporter and runtime, with the quantized kernels the programs call registered."""
    try:
        import executorch.kernels.quantized  # noqa: F401  (quantized_decomposed kernels in the runtime)
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError:
        raise WorkbenchError(f"ExecuTorch is not installed: {INSTALL}") from None
    return XnnpackPartitioner, to_edge_transform_and_lower, Runtime


def carried_layout(name: str, qw) -> tuple[int, int | None]:
    """(bits, group) of a quantized layer as XNNPACK holds it (group None: per channel); a one-line PlanError
    naming the layer and its layout when XNNPACK has no layout for it."""
    out, inp = qw.shape
    group = qw.group_size if qw.group_size and qw.group_size < inp else None
    what = f"{qw.bits}-bit " + (f"per-{qw.group_size}" if group else "per-channel")
    if not qw.symmetric or qw.two_level or qw.mins is not None or qw.super_block:
        what += " asymmetric" if qw.zeros is not None else " two-level / minimum"
        why = "XNNPACK takes symmetric codes with one float scale per group or channel"
    elif qw.bits == 4 and (group is None or group % GROUP_MULTIPLE == 0):
        return 4, group
    elif qw.bits == 8 and group is None:
        return 8, None
    elif qw.bits == 8:
        why = "XNNPACK holds int8 weights per channel only"
    elif qw.bits == 4:
        why = f"XNNPACK's 4-bit groups are a multiple of {GROUP_MULTIPLE} columns"
    else:
        why = "XNNPACK holds 4 and 8-bit codes"
    raise PlanError(f"executorch cannot carry layer '{name}' as {what} codes: {why}; give it symmetric int4 in "
                    f"groups of a multiple of {GROUP_MULTIPLE} or per channel, or int8 per channel (e.g. `workbench "
                    "quantize MODEL --bits 8 --group-size 0 --out Q`, then convert Q)")


def _quantized_ops():
    """``torch.ops.quantized_decomposed``: the (de)quantize ops XNNPACK's partitioner matches."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the library)
    return torch.ops.quantized_decomposed


class _PlanLinear(nn.Module):
    """A quantized linear layer as XNNPACK's dynamically quantized fully-connected op: int8 activations per
    token, the plan's codes (``codes``, int8) and float32 scales, zero points 0."""

    def __init__(self, name: str, qw, bias: torch.Tensor | None):
        super().__init__()
        self.bits, self.group = carried_layout(name, qw)
        scales = qw.scales.float()
        self.register_buffer("codes", qw.qweight.to(torch.int8).clone())
        self.register_buffer("scales", scales.clone() if self.group else scales[:, 0].clone())
        self.register_buffer("zeros", torch.zeros(self.scales.shape, dtype=torch.int8))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.qmin, self.qmax = -(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = _quantized_ops()
        s, zp = q.choose_qparams_per_token_asymmetric(x, torch.int8)
        x = q.dequantize_per_token(q.quantize_per_token(x, s, zp, -128, 127, torch.int8), s, zp, -128, 127,
                                   torch.int8, torch.float32)
        if self.group:
            w = q.dequantize_per_channel_group(self.codes, self.scales, self.zeros, self.qmin, self.qmax, torch.int8,
                                               self.group, torch.float32)
        else:
            w = q.dequantize_per_channel(self.codes, self.scales, self.zeros, 0, self.qmin, self.qmax, torch.int8,
                                         out_dtype=torch.float32)
        return F.linear(x, w, self.bias)


def _linear(name: str, module: nn.Module) -> nn.Module:
    """The plan's layer ``module`` of the simulation: its codes (``_PlanLinear``), or its float32 weight."""
    bias = getattr(module, "bias", None)
    if hasattr(module, "qweight"):
        return _PlanLinear(name, module.quantized, bias)
    lin = nn.Linear(module.in_features, module.out_features, bias=bias is not None)
    lin.weight = nn.Parameter(module.weight.detach().float().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    return lin


class _Norm(nn.Module):
    """transformers' RMSNorm in float32."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        self.weight = nn.Parameter(module.weight.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class EtDecoder(nn.Module):
    """The simulation's decoder for ``torch.export``: ``forward(tokens [1, S], positions [S]) -> logits [1, S, V]``,
    each layer's KV cache a ``[1, kv_heads, max_len, head_dim]`` buffer written at ``positions``. A query sees
    the cache up to its own position, so a fresh prompt from position 0 needs no reset."""

    def __init__(self, sim_model: nn.Module, max_len: int):
        super().__init__()
        spec = DecoderSpec.from_model(sim_model)
        self.max_len, self.head_dim, self.rope_scaling = max_len, spec.head_dim, spec.rope_scaling
        self.heads = [spec.heads_of(i) for i in range(spec.layers)]
        base = spec.base
        embed = base.embed_tokens.weight.detach().float()
        if torch.equal(embed.half().float(), embed):  # float16 values (the plan's fp16): stored as they are
            embed = embed.half()
        self.embed = nn.Parameter(embed.clone(), requires_grad=False)
        self.register_buffer("inv_freq", torch.from_numpy(np.asarray(spec.inv_freq, np.float32)).clone())
        self.blocks = nn.ModuleList()
        for i, block in enumerate(base.layers):
            p, a, m = f"model.layers.{i}", block.self_attn, block.mlp
            b = nn.Module()
            b.attn_norm, b.mlp_norm = _Norm(block.input_layernorm), _Norm(block.post_attention_layernorm)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(b, n, _linear(f"{p}.self_attn.{n}", getattr(a, n)))
            for n in ("gate_proj", "up_proj", "down_proj"):
                setattr(b, n, _linear(f"{p}.mlp.{n}", getattr(m, n)))
            if spec.qk_norm:
                b.q_norm, b.k_norm = _Norm(a.q_norm), _Norm(a.k_norm)
            kv = self.heads[i][1]
            b.register_buffer("k_cache", torch.zeros(1, kv, max_len, spec.head_dim), persistent=False)
            b.register_buffer("v_cache", torch.zeros(1, kv, max_len, spec.head_dim), persistent=False)
            self.blocks.append(b)
        self.qk_norm = spec.qk_norm
        self.norm = _Norm(base.norm)
        self.lm_head = _linear("lm_head", spec.model.get_output_embeddings())

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        seq, d = tokens.shape[1], self.head_dim
        h = F.embedding(tokens, self.embed).float()
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling  # [S, d]
        visible = torch.arange(self.max_len)[None, :] <= positions[:, None]  # [S, max_len]
        bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
        for b, (hq, hkv) in zip(self.blocks, self.heads):
            x = b.attn_norm(h)
            q = b.q_proj(x).view(1, seq, hq, d)
            k = b.k_proj(x).view(1, seq, hkv, d)
            v = b.v_proj(x).view(1, seq, hkv, d)
            if self.qk_norm:
                q, k = b.q_norm(q), b.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            b.k_cache[:, :, positions] = k
            b.v_cache[:, :, positions] = v
            keys = b.k_cache.repeat_interleave(hq // hkv, dim=1)
            values = b.v_cache.repeat_interleave(hq // hkv, dim=1)
            att = torch.softmax(q @ keys.transpose(2, 3) / (d ** 0.5) + bias, dim=-1) @ values
            h = h + b.o_proj(att.transpose(1, 2).reshape(1, seq, hq * d))
            x = b.mlp_norm(h)
            h = h + b.down_proj(F.silu(b.gate_proj(x)) * b.up_proj(x))
        return self.lm_head(self.norm(h))


def export_pte(sim_model: nn.Module, path: str | Path, *, max_len: int) -> dict:
    """``sim_model`` as an XNNPACK ``.pte`` at ``path``: what was lowered (delegated layers, seconds)."""
    XnnpackPartitioner, to_edge_transform_and_lower, _ = _import_executorch()
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from torch.export import Dim, export
    t = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        # torch's pytree deprecation notes, once per node, and the emitter's note on mutated buffers (initialised here)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Mutation on a buffer")
        module = EtDecoder(sim_model, max_len).eval()
        seq = Dim("seq", min=1, max=max_len)
        example = (torch.zeros(1, 3, dtype=torch.long), torch.arange(3, dtype=torch.long))
        ep = export(module, example, dynamic_shapes=({1: seq}, {0: seq}), strict=False)
        exported = time.perf_counter() - t
        # the caches start as zeros: a masked position weighs 0, and 0 times uninitialised memory may be NaN
        program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch(
            ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(["k_cache", "v_cache"])]))
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(program.buffer)
    tmp.replace(path)
    graph = program.exported_program().graph_module.graph
    delegates = sum(1 for n in graph.nodes if n.op == "call_function" and "executorch_call_delegate" in str(n.target))
    portable = sorted({str(n.target).split(".")[-2] for n in graph.nodes if n.op == "call_function"
                       and "executorch_call_delegate" not in str(n.target) and str(n.target).count(".") >= 2})
    quantized = sum(isinstance(m, _PlanLinear) for m in module.modules())
    return {"max_len": max_len, "delegate_calls": delegates, "portable_ops": portable,
            "quantized_linear_layers": quantized,
            "export_seconds": exported, "lower_seconds": time.perf_counter() - t - exported}


def pte_weights(path: str | Path) -> dict[str, bytes]:
    """Every named constant buffer a ``.pte`` holds (XNNPACK's weights and scales), by key: read back from
    the file, so a check against the plan reads what the runtime loads."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    pte = deserialize_pte_binary(Path(path).read_bytes())
    if pte.named_data is None:
        return {}
    buffers = pte.named_data.buffers
    return {key: bytes(buffers[e.buffer_index]) for key, e in pte.named_data.pte_data.items()}


def plan_weight_bytes(qw) -> tuple[bytes, bytes]:
    """(codes, scales) of a quantized layer as XNNPACK stores them: 4-bit codes plus 8, two a byte, the first
    in the low nibble (int8 codes as they are); a grouped layer's scales as bfloat16, else float32."""
    bits, group = carried_layout("layer", qw)
    codes = qw.qweight.to(torch.int8)
    if bits == 4:
        u = (codes.to(torch.int16) + 8).to(torch.uint8)
        if u.shape[1] % 2:
            u = F.pad(u, (0, 1))
        flat = u.reshape(-1)
        codes = (flat[1::2] << 4 | flat[0::2])
    scales = qw.scales.float().to(torch.bfloat16).view(torch.int16) if group else qw.scales.float()[:, 0]
    return codes.contiguous().numpy().tobytes(), scales.contiguous().numpy().tobytes()


def check_pte_codes(path: str | Path, qm) -> int:
    """How many of the plan's quantized layers the ``.pte`` holds with the plan's own codes and scales (as XNNPACK
    stores them); a layer whose bytes are not found is an error naming it."""
    stored = set(pte_weights(path).values())
    found = 0
    for name, qw in qm.weights.items():
        if qm.layer(name).kind != "linear":
            continue
        codes, scales = plan_weight_bytes(qw)
        if codes not in stored or scales not in stored:
            raise WorkbenchError(f"'{path}' does not hold the plan's codes and scales of '{name}': convert again")
        found += 1
    return found


PTE_MAGIC = b"ET"  # a .pte is a flatbuffer whose file identifier (bytes 4-8) is "ET" and a two-digit version


def check_pte_header(path: str | Path) -> None:
    """ModelLoadError unless ``path`` starts as an ExecuTorch program does (its flatbuffer identifier ``ET..``,
    a root offset inside the file): checked before the runtime parses it."""
    path = Path(path)
    folder_file(path.parent, path.name, path.parent, "program", at_least=16, why="of a program's header")
    with open(path, "rb") as f:
        head = f.read(8)
    root = int.from_bytes(head[:4], "little")
    if head[4:6] != PTE_MAGIC or not head[6:8].isdigit() or not 8 <= root < path.stat().st_size:
        raise ModelLoadError(f"'{path}' is not an ExecuTorch program (its header is {head[4:8]!r}, not 'ET' and a "
                             "version): it is damaged; convert it again")


class ExecuTorchLM:
    """A ``model.pte`` in ExecuTorch's runtime: logits of a fresh prompt, prefill / decode steps through the
    program's own KV cache, and timings of the runtime's ``execute`` calls for both."""

    runtime = "ExecuTorch (XNNPACK)"

    def __init__(self, folder: str | Path, threads: int | None = None):
        self.folder = Path(folder)
        path = self.folder / PTE_FILE
        if not path.is_file():
            raise ModelLoadError(f"'{self.folder}' has no {PTE_FILE}: convert it again "
                                 "(`workbench convert MODEL --target executorch --out DIR`)")
        _, _, Runtime = _import_executorch()
        self.threads = threads or 1
        from executorch.extension.pybindings import portable_lib
        t = time.perf_counter()
        check_pte_header(path)
        try:
            with native_output_to():  # the runtime logs the CPU probe and the thread pool from C++
                portable_lib._unsafe_reset_threadpool(self.threads)
                self.program = Runtime.get().load_program(path)
                self.method = self.program.load_method("forward")
        except RuntimeError as e:  # the runtime's own verdict on a file that is not a whole program
            first = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
            raise ModelLoadError(f"ExecuTorch could not load '{path}' ({first}): it is damaged or truncated; "
                                 "convert it again") from None
        if self.method is None:
            raise ModelLoadError(f"'{path}' has no forward method: convert it again")
        meta = self.method.metadata
        self.max_length = int(meta.input_tensor_meta(0).sizes()[1]) if meta is not None else None
        self.load_seconds = time.perf_counter() - t

    def _run(self, ids: Sequence[int], start: int) -> np.ndarray:
        tokens = torch.tensor([[int(i) for i in ids]], dtype=torch.long)
        if self.max_length is not None and start + tokens.shape[1] > self.max_length:
            raise WorkbenchError(f"'{self.folder / PTE_FILE}' holds {self.max_length} positions, not "
                                 f"{start + tokens.shape[1]}: shorten the text, or convert again with a larger --ctx")
        positions = torch.arange(start, start + tokens.shape[1], dtype=torch.long)
        return self.method.execute([tokens, positions])[0].numpy()

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits ``[1, n, vocab]`` of one fresh prompt (from position 0), every position."""
        ids = np.asarray(input_ids).reshape(-1)
        return self._run(ids.tolist(), 0).reshape(1, len(ids), -1)

    def run_prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray, None]:
        """A fresh prompt into the program's cache: the last position's logits, all of them, and no KV cache
        of ours (the program keeps its own); ``run_decode`` calls follow in order."""
        out = self._run(prompt, 0)
        return out[0, -1], out, None

    def run_decode(self, token: int, kv, position: int) -> tuple[np.ndarray, None, None]:
        """``token`` at ``position`` through the program's cache (``kv`` unused: the program holds the cache)."""
        return self._run([token], position)[0, -1], None, None

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        """The runtime's time for ``prompt`` (one ``execute`` of the program)."""
        t = time.perf_counter()
        self._run(prompt, 0)
        return time.perf_counter() - t

    def decode_seconds(self, prompt: Sequence[int], steps: int) -> float:
        """The runtime's time for ``steps`` single-token calls after ``prompt`` (greedy)."""
        last = self._run(prompt, 0)[0, -1]
        pos, spent = len(prompt), 0.0
        for _ in range(steps):
            t = time.perf_counter()
            last = self._run([int(np.argmax(last))], pos)[0, -1]
            spent += time.perf_counter() - t
            pos += 1
        return spent


def open_executorch(folder: str | Path, *, threads: int | None = None) -> ExecuTorchLM:
    return ExecuTorchLM(folder, threads=threads)


def convert_executorch(job) -> None:
    """The simulation as an XNNPACK ``.pte`` holding the plan's codes, scored and timed in ExecuTorch's runtime."""
    prep, report = job.prep, job.report
    qm = prep.qm
    for name, qw in qm.weights.items():  # refuse before exporting, naming the layer
        if qm.layer(name).kind == "linear":
            carried_layout(name, qw)
    model = prep.sim_lm.model
    max_len = min(int(getattr(model.config, "max_position_embeddings", 0) or job.default_ctx),
                  max(job.ctx or job.default_ctx, job.default_ctx))
    job.say("exporting and lowering to ExecuTorch (XNNPACK)")
    before, reset = settled_rss_mb(), reset_peak_rss()
    t = time.perf_counter()
    info = export_pte(model, job.out / PTE_FILE, max_len=max_len)
    report.details["seconds"]["write"] = time.perf_counter() - t
    if reset and before is not None:
        info["peak_rss_added_mb"] = (rss_mb("VmHWM") or before) - before
    prep.sim_lm.tokenizer.save_pretrained(str(job.out))
    info["plan_layers_checked"] = check_pte_codes(job.out / PTE_FILE, qm)
    report.details["executorch"] = info
    grouped = any(carried_layout(n, q)[1] for n, q in qm.weights.items() if qm.layer(n).kind == "linear")
    report.notes.append("the plan's integer codes are stored in the .pte as they are (checked layer by layer); "
                        "activations are quantized to int8 per token at run time (XNNPACK's dynamically quantized "
                        "linear), which the simulation does not do")
    if grouped:
        report.notes.append("XNNPACK holds grouped 4-bit scales as bfloat16: each group's float16 scale rounded to 8 "
                            "significant bits")
    report.notes.append(f"the program's KV cache holds {max_len} positions")
    embeds = [n for n in qm.weights if qm.layer(n).kind == "embedding"]
    if embeds:
        report.notes.append(f"{', '.join(embeds)}: the plan's codes are held as their dequantized float values "
                            "(the program looks the embedding up in float)")
    runner = ExecuTorchLM(job.out, threads=2)
    score_in_runtime(job, runner, "executorch", job.out / PTE_FILE, "ExecuTorch's Method.execute, timed around each "
                     "call", warm_up=True)


TARGET = register_target(Target(
    "executorch", "ExecuTorch (XNNPACK)", rules=None, convert=convert_executorch, runnable=True,
    runner=open_executorch, files=FILES, module=__name__,
    precision_note="XNNPACK holds symmetric 4-bit codes per channel or per group of a multiple of 32 columns and "
                   "8-bit codes per channel; float layers stay float32"))
