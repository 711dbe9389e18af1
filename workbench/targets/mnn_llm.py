"""MNN-LLM, ``mnn-llm``: the plan's model as the directory MNN's own LLM engine (``llm_demo``, the MNN chat
app, ``MNN.llm``) loads, run and timed by that engine here.

    convert("demo", "mnn-llm", "out/mnn-llm", bits=4)     # config.json, llm_config.json, llm.mnn, ...
    lm = MnnLlm("out/mnn-llm"); lm.logits(ids); lm.steps(); lm.prefill_seconds(prompt)

The directory is what MNN's engine reads (its ``llmconfig.hpp`` / ``llm.cpp``): ``config.json`` (runtime
settings, names the files), ``llm_config.json`` (model shape), ``llm.mnn`` + ``llm.mnn.weight`` (the
decoder graph and its weights), ``embeddings_bf16.bin`` (the token embedding, read row by row from disk)
and ``tokenizer.txt`` (MNN's text tokenizer format: magic 430, type 3 = byte-level BPE vocabulary and merges).

The graph takes ``input_ids`` (the embedded tokens, ``[seq, 1, hidden]``), ``attention_mask``,
``position_ids`` ``[1, seq]`` and ``logits_index`` (``-1``: the last position, ``0``: all of them) and
gives ``logits``. Its attention is MNN's ``Attention`` op with ``kv_cache`` on: the engine keeps the KV
cache itself, so one graph serves prefill and decode. It is written here as an ONNX graph whose attention
is a custom ``FusedAttention`` node, converted by MNN's converter, its custom nodes rewritten as
``Attention`` ops in the converter's JSON form and converted back with ``--weightQuantBits`` (the same
asymmetric re-quantization of the simulated weights that reproduces the plan's integers in the ``mnn``
target, ``mnn_weight_args``); a float output layer keeps float weights the same way.
"""
from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError, WorkbenchError
from ..workspace import atomic_write_json
from .mnn import mnn_weight_args, quiet_fds, convert_to_mnn, keep_matmul_weights_float, run_mnnconvert
from .registry import Target, register_target

__all__ = ["export_engine_onnx", "plan_codes_layout", "write_plan_codes", "write_tokenizer_txt", "write_mnn_llm_folder", "MnnLlm", "open_mnn_llm",
           "convert_mnn_llm", "TARGET", "FILES"]

FILES = ("llm.mnn", "llm.mnn.weight", "embeddings_bf16.bin", "config.json", "llm_config.json", "tokenizer.txt")
MODEL_TYPES = ("qwen2", "qwen3", "llama")  # decoders whose blocks _EngineGraph rebuilds as they compute
PROFILE_PROMPT = 64  # held-out tokens of the prompt the conversion times the engine on
TOKENIZER_MAGIC, HUGGINGFACE_BPE = 430, 3  # tokenizer.txt's header, as MNN's tokenizer.cpp reads it


class _FusedAttentionOp(torch.autograd.Function):
    """A node MNN's converter keeps (``--allowCustomOp``) and this module turns into MNN's ``Attention`` op."""

    @staticmethod
    def symbolic(g, q, k, v, mask, output_dim, layer_index):
        from torch.onnx.symbolic_helper import _get_tensor_sizes
        out = g.op("LlmExporter::FusedAttention", q, k, v, mask, output_dim_i=output_dim, kv_cache_i=1,
                   name_s=f"/layers.{layer_index}/self_attn/FusedAttention", layer_index_i=layer_index,
                   kv_shared_layer_index_i=-1)
        return out.setType(q.type().with_sizes(_get_tensor_sizes(q)[:2] + [output_dim]))

    @staticmethod
    def forward(ctx, q, k, v, mask, output_dim, layer_index):
        """Causal attention without a cache: what the engine's op computes on a prompt (used for tracing)."""
        rep = q.shape[2] // k.shape[2]
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        out = nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], output_dim)


def _linear(module) -> nn.Linear:
    """A float32 ``nn.Linear`` with the weights a (possibly quantized) layer computes with."""
    w = module.weight.detach().float()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=getattr(module, "bias", None) is not None)
    lin.weight.data = w.clone()
    if lin.bias is not None:
        lin.bias.data = module.bias.detach().float().clone()
    return lin


class _Norm(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.weight = nn.Parameter(module.weight.detach().float().clone(), requires_grad=False)
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _EngineGraph(nn.Module):
    """The decoder as MNN's engine calls it: embedded tokens in, logits at ``logits_index`` onward out."""

    def __init__(self, model):
        super().__init__()
        cfg = model.config
        if cfg.model_type not in MODEL_TYPES:
            raise WorkbenchError(f"mnn-llm writes {', '.join(MODEL_TYPES)} decoders, not '{cfg.model_type}'; "
                                 "use the mnn target for this model")
        inner = model.model
        names = {id(m): n for n, m in model.named_modules()}
        self.layer_of: dict[str, nn.Linear] = {}  # layer name -> its float copy here (to find it in the graph)

        def lin(module) -> nn.Linear:
            copy = _linear(module)
            self.layer_of[names[id(module)]] = copy
            return copy
        self.hidden, self.heads, self.kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rot = inner.rotary_emb
        self.register_buffer("inv_freq", rot.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self.blocks = nn.ModuleList()
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            b = nn.Module()
            b.ln1, b.ln2 = _Norm(layer.input_layernorm), _Norm(layer.post_attention_layernorm)
            b.q, b.k, b.v, b.o = (lin(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
            b.qn = _Norm(a.q_norm) if getattr(a, "q_norm", None) is not None else None
            b.kn = _Norm(a.k_norm) if getattr(a, "k_norm", None) is not None else None
            b.gate, b.up, b.down = (lin(p) for p in (m.gate_proj, m.up_proj, m.down_proj))
            self.blocks.append(b)
        self.norm, self.lm_head = _Norm(inner.norm), lin(model.lm_head)

    def forward(self, input_ids, attention_mask, position_ids, logits_index):
        h = input_ids.view(1, -1, self.hidden)
        n = h.shape[1]
        freqs = position_ids.float()[0, :, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = (emb.cos() * self.rope_scale)[None, :, None], (emb.sin() * self.rope_scale)[None, :, None]
        for i, b in enumerate(self.blocks):
            x = b.ln1(h)
            q = b.q(x).view(1, n, self.heads, self.head_dim)
            k = b.k(x).view(1, n, self.kv_heads, self.head_dim)
            v = b.v(x).view(1, n, self.kv_heads, self.head_dim)
            if b.qn is not None:
                q, k = b.qn(q), b.kn(k)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            h = h + b.o(_FusedAttentionOp.apply(q, k, v, attention_mask, self.heads * self.head_dim, i))
            x = b.ln2(h)
            h = h + b.down(nn.functional.silu(b.gate(x)) * b.up(x))
        h = h[:, logits_index.to(torch.int64):, :]
        return self.lm_head(self.norm(h))


def export_engine_onnx(model, path: str | Path) -> tuple[Path, str]:
    """The engine's graph of ``model`` (weights as it computes with them, float32) as ONNX, each linear layer's
    MatMul output named after the layer (MNN names the op it makes from it so); and the name of the output
    layer's weight initializer."""
    import hashlib

    import onnx
    from onnx import numpy_helper
    graph = _EngineGraph(model).eval()
    n = 3
    args = (torch.zeros(n, 1, graph.hidden), torch.zeros(1, 1, n, n), torch.arange(n, dtype=torch.int32)[None],
            torch.tensor([-1], dtype=torch.int32))
    path = Path(path)
    with torch.inference_mode(False), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(graph, args, str(path), input_names=["input_ids", "attention_mask", "position_ids",
                                                                 "logits_index"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "seq_len"}, "attention_mask": {2: "seq_len", 3: "seq_len"},
                                        "position_ids": {1: "seq_len"}})
    proto = onnx.load(str(path))
    digest = {hashlib.sha1(lin.weight.detach().T.contiguous().numpy().tobytes()).hexdigest(): name
              for name, lin in graph.layer_of.items()}
    by_init = {}
    for init in proto.graph.initializer:
        if len(init.dims) == 2:
            name = digest.get(hashlib.sha1(numpy_helper.to_array(init).tobytes()).hexdigest())
            if name is not None:
                by_init[init.name] = name
    renamed = {}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and node.input[1] in by_init and node.output[0] != "logits":
            renamed[node.output[0]] = by_init[node.input[1]]
            node.output[0] = by_init[node.input[1]]
    for node in proto.graph.node:
        for i, x in enumerate(node.input):
            if x in renamed:
                node.input[i] = renamed[x]
    head = next(node for node in proto.graph.node if "logits" in node.output)
    if head.op_type != "MatMul":
        raise WorkbenchError(f"the exported output layer is a {head.op_type}, not a MatMul: export again")
    onnx.save(proto, str(path))
    return path, head.input[1]


def plan_codes_layout(qm) -> tuple[int, int] | None:
    """(bits, block) when every quantized linear layer is symmetric at one width (4 or 8) and one block size with
    one float scale per block: MNN's own block layout (codes and a scale per block) then holds the plan's integers
    as they are, whatever rounded them (scale search, AWQ, GPTQ). None otherwise."""
    qws = [q for name, q in qm.weights.items() if qm.layer(name).kind == "linear"]
    if not qws or any(q.zeros is not None or q.sub_scales is not None or q.mins is not None or q.super_block
                      for q in qws):
        return None
    kinds = {(q.bits, q.effective_group_size) for q in qws}
    if len(kinds) != 1:
        return None
    bits, block = next(iter(kinds))
    return (bits, block) if bits in (4, 8) and block else None


def write_plan_codes(doc: dict, qm, bits: int, block: int) -> int:
    """Put the plan's codes and scales into MNN's quantized ops (in the converter's JSON form): each block's
    ``alpha`` is its scale, its codes index MNN's code table (``-2^(b-1)`` .. ``2^(b-1)-1``), high nibble first."""
    done = 0
    for op in doc.get("oplists", []):
        if op.get("type") != "Convolution":
            continue
        name = op.get("name", "").split("__matmul_converted")[0]
        qw = qm.weights.get(name)
        q = (op.get("main") or {}).get("quanParameter")
        if qw is None or q is None:
            continue
        buf = np.asarray(q["buffer"], dtype=np.int64).astype(np.uint8)
        dims = 8 if q.get("shapeInt32") else 4  # the two dims: unsigned 16-bit, or 32-bit above 65,535
        rows, width = (int(x) for x in np.frombuffer(buf[1:1 + dims].tobytes(), np.int32 if dims == 8 else np.uint16))
        table = int(buf[1 + dims]) or 256
        header = 2 + dims + table
        codes = qw.qweight.to(torch.int16).numpy().reshape(-1, block) + (1 << (bits - 1))
        if (rows, width) != codes.shape or q.get("aMaxOrBits") != bits or len(q["alpha"]) != rows:
            raise WorkbenchError(f"MNN laid out '{name}' as {rows} x {width} {q.get('aMaxOrBits')}-bit blocks, not the "
                                 f"plan's {codes.shape[0]} x {block} {bits}-bit ones: this MNN version is not the one "
                                 "the project pins")
        flat = codes.reshape(-1).astype(np.uint8)
        packed = (flat[0::2] << 4 | flat[1::2]) if bits == 4 else flat
        q["buffer"] = buf[:header].tolist() + packed.astype(np.int8).tolist()
        q["alpha"] = qw.scales.float().numpy().reshape(-1).tolist()
        done += 1
    return done


def _attention_ops(doc: dict) -> int:
    """Rewrite the converter's custom ``FusedAttention`` ops (in its JSON form) as MNN ``Attention`` ops."""
    count = 0
    for op in doc.get("oplists", []):
        main = op.get("main") or {}
        if op.get("type") != "Extra" or main.get("type") != "FusedAttention":
            continue
        attrs = {a["key"]: a for a in main.get("attr", [])}
        op.update({"type": "Attention", "main_type": "AttentionParam", "defaultDimentionFormat": "NHWC",
                   "name": attrs["name"]["s"],
                   "main": {"kv_cache": bool(attrs["kv_cache"].get("i", 1)),
                            "layer_index": attrs.get("layer_index", {}).get("i", -1),
                            "kv_shared_layer_index": -1}})
        count += 1
    return count


def write_tokenizer_txt(tokenizer, path: str | Path, stop_ids: Sequence[int]) -> Path:
    """The model's byte-level BPE tokenizer in MNN's ``tokenizer.txt`` format (header, special / stop / prefix
    ids, vocabulary in id order, merges by rank); other tokenizer kinds are refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise WorkbenchError("mnn-llm needs a fast (tokenizer.json) tokenizer to write MNN's tokenizer.txt")
    doc = json.loads(backend.to_str())
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or (doc.get("pre_tokenizer") or {}).get("type") not in ("ByteLevel", "Sequence"):
        raise WorkbenchError(f"mnn-llm writes byte-level BPE tokenizers; this one is {model.get('type')}: use the "
                             "mnn target, or MNN's llmexport.py for the tokenizer")
    vocab = dict(model["vocab"])
    special = []
    for tok in doc.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
        if tok.get("special"):
            special.append(tok["id"])
    size = max(vocab.values()) + 1
    by_id = [""] * size
    for text, i in vocab.items():
        by_id[i] = text
    if any("\n" in t for t in by_id):
        raise WorkbenchError("a token of this tokenizer holds a newline, which MNN's line-based tokenizer.txt "
                             "cannot store")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    stops = [int(s) for s in dict.fromkeys(stop_ids)]
    lines = [f"{TOKENIZER_MAGIC} {HUGGINGFACE_BPE}", f"{len(special)} {len(stops)} 0",
             " ".join(str(i) for i in special + stops), f"{size} {len(merges)}", *by_id, *merges]
    path = Path(path)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _stop_ids(lm) -> list[int]:
    gen = getattr(lm.model, "generation_config", None)
    ids = [getattr(gen, "eos_token_id", None), lm.tokenizer.eos_token_id]
    out = []
    for i in ids:
        out += list(i) if isinstance(i, (list, tuple)) else [i] if i is not None else []
    return [int(i) for i in dict.fromkeys(out)]


def write_mnn_llm_folder(sim_lm, qm, out: str | Path, work: str | Path, *, threads: int = 4) -> dict:
    """MNN's LLM model directory for the simulation ``sim_lm`` of ``qm``; returns what was decided (notes)."""
    out, work = Path(out), Path(work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model = sim_lm.model
    direct = plan_codes_layout(qm)
    bits, block, notes = mnn_weight_args(qm)
    if direct is not None:  # the plan's own codes and scales written into MNN's layout (any rounding method)
        bits, block = direct
        notes = [n for n in notes if "stores the simulated weights in float" not in n and "re-quantizes" not in n]
        notes.append(f"the plan's {bits}-bit codes and per-{block} float scales are written into MNN's quantized "
                     "weights as they are (MNN's symmetric block layout)")
    embed = model.get_input_embeddings()
    # the embedding is not in the graph here (embeddings_bf16.bin holds it): drop the mnn target's notes on it
    embed_names = [r.name for r in qm.layers if r.kind == "embedding"]
    notes = [n for n in notes if not any(n.startswith(e) for e in embed_names)]
    onnx_path, head = export_engine_onnx(model, work / "llm.onnx")
    float_head = "lm_head" not in qm.weights
    kept = []
    if bits and float_head:
        src = work / "llm-float-head.onnx"
        kept = keep_matmul_weights_float(onnx_path, src, [head])
        onnx_path = src
    if kept:
        notes.append("the output layer, float in the plan, keeps float32 weights in llm.mnn (a [1, K, N] weight, "
                     "which MNN's weight quantization leaves alone)")
    # with --weightQuantAsymmetric this converter writes one scale per block (checked by write_plan_codes), without it
    # a (minimum, scale) pair
    plain = convert_to_mnn(onnx_path, work / "plain.mnn", weight_bits=bits, block_size=block, asymmetric=True,
                           extra=["--allowCustomOp"])
    graph_json = work / "llm.json"
    run_mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", str(plain), "--JsonFile", str(graph_json)])
    doc = json.loads(graph_json.read_text(encoding="utf-8"))
    written = write_plan_codes(doc, qm, bits, block) if direct is not None else 0
    quantized = sum(1 for name in qm.weights if qm.layer(name).kind == "linear")
    if direct is not None and written != quantized:
        raise WorkbenchError(f"found {written} of the plan's {quantized} quantized layers among MNN's ops: export again")
    rewritten = _attention_ops(doc)
    if rewritten != len(model.model.layers):
        raise WorkbenchError(f"MNN's converter kept {rewritten} of {len(model.model.layers)} attention ops: "
                             "this MNN version does not carry the custom op; install the pinned MNN")
    graph_json.write_text(json.dumps(doc), encoding="utf-8")
    rebuilt = convert_to_mnn(graph_json, work / "llm.mnn", source="JSON")  # JSON input keeps its weights inline
    convert_to_mnn(rebuilt, out / "llm.mnn", source="MNN", extra=["--saveExternalData"])
    if not (out / "llm.mnn.weight").is_file():
        raise WorkbenchError(f"MNN's converter wrote no llm.mnn.weight beside '{out / 'llm.mnn'}': convert again")
    emb = embed.weight.detach()
    (out / "embeddings_bf16.bin").write_bytes(emb.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    write_tokenizer_txt(sim_lm.tokenizer, out / "tokenizer.txt", _stop_ids(sim_lm))
    cfg = model.config
    atomic_write_json(out / "llm_config.json", {
        "model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "layer_nums": cfg.num_hidden_layers,
        "attention_mask": "float", "attention_type": "full", "is_visual": False, "is_audio": False,
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0)})
    atomic_write_json(out / "config.json", {
        "llm_model": "llm.mnn", "llm_weight": "llm.mnn.weight", "embedding_file": "embeddings_bf16.bin",
        "tokenizer_file": "tokenizer.txt", "backend_type": "cpu", "thread_num": threads, "precision": "high",
        "memory": "high", "sampler_type": "greedy", "use_template": False, "max_new_tokens": 512})
    notes.append("the token embedding is stored as bfloat16 (embeddings_bf16.bin, the engine's float embedding "
                 "format): its simulated values rounded to 8 significant bits")
    return {"weight_bits": bits, "block": block, "plan_codes_written": written,
            "kept_float": kept,
            "attention_ops": rewritten, "notes": notes}


class MnnLlm:
    """A ``mnn-llm`` folder in MNN's own LLM engine: logits, token steps, and the engine's own timings.

    ``logits(ids)`` runs a fresh prompt with every position's logits (``all_logits``); ``steps()`` is what
    ``stream_tokens`` drives (the engine's KV cache, one token a step); ``prefill_seconds`` and
    ``decode_seconds`` read the engine's ``prefill_us`` / ``decode_us`` counters.
    """

    runtime = "MNN-LLM"

    def __init__(self, folder: str | Path, threads: int | None = None):
        self.folder = Path(folder)
        missing = [f for f in FILES if not (self.folder / f).is_file()]
        if missing:
            raise ModelLoadError(f"'{self.folder}' has no {', '.join(missing)}: convert it again "
                                 "(`workbench convert MODEL --target mnn-llm --out DIR`)")
        self.threads = threads or 1
        t = time.perf_counter()
        self.m = self._engine(all_logits=False)
        self.load_seconds = time.perf_counter() - t
        self._scorer = None

    def _engine(self, *, all_logits: bool):
        """The engine over the folder's config.json; ``all_logits`` is fixed when it loads (it caches its graph)."""
        try:
            with quiet_fds():
                import MNN.llm as llm
        except ImportError:
            raise WorkbenchError("MNN's LLM engine is not available: install the MNN package "
                                 "(pip install -c constraints.txt MNN)") from None
        with quiet_fds():
            m = llm.create(str(self.folder / "config.json"))
            m.set_config({"thread_num": self.threads, "all_logits": all_logits})
            m.load()
            probe = m.forward([0])  # load() says nothing of failure; a graph that did not load gives no logits
        if probe is None or len(probe.shape) != 3:
            raise ModelLoadError(f"MNN's LLM engine could not load '{self.folder}': convert it again")
        m.reset()
        return m

    @staticmethod
    def _forward(engine, ids: Sequence[int]) -> np.ndarray:
        with quiet_fds():
            out = engine.forward([int(i) for i in ids])
        a = np.array(out.read(), dtype=np.float32, copy=True)  # read() views the engine's buffer, reused next step
        return a.reshape(-1, a.shape[-1])

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits ``[1, n, vocab]`` of one fresh prompt, every position (a second engine, loaded with
        ``all_logits``, on first use)."""
        if self._scorer is None:
            self._scorer = self._engine(all_logits=True)
        ids = np.asarray(input_ids).reshape(-1)
        self._scorer.reset()
        return self._forward(self._scorer, ids).reshape(1, len(ids), -1)

    def steps(self, max_length: int | None = None) -> "_EngineSteps":
        """One generation's steps through the engine's own KV cache (what ``stream_tokens`` drives)."""
        return _EngineSteps(self)

    @property
    def context(self):
        """The engine's counters of its last generation (``prompt_len``, ``gen_seq_len``, ``prefill_us``, ...)."""
        return self.m.context

    def run_prefill(self, prompt: Sequence[int]) -> tuple[np.ndarray, np.ndarray, None]:
        """A fresh prompt through the engine's cache: the last position's logits (twice: the engine gives only
        that one here) and no KV cache of ours (the engine keeps its own); ``run_decode`` calls follow in order."""
        self.m.reset()
        last = self._forward(self.m, prompt)[-1]
        return last, last[None, None], None

    def run_decode(self, token: int, kv, position: int) -> tuple[np.ndarray, None, None]:
        """The next token through the engine's own cache (``kv`` is unused: the engine's state is the cache, so
        steps go in order after ``run_prefill``)."""
        return self._forward(self.m, [token])[-1], None, None

    def _generate(self, prompt: Sequence[int], new_tokens: int):
        """The engine's own generate loop (greedy, as config.json says); its context after."""
        self.m.reset()
        with quiet_fds():
            self.m._c_obj.generate([int(i) for i in prompt], int(new_tokens))
        return self.m.context

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        """The engine's own prefill time of ``prompt`` (``context.prefill_us``)."""
        return self._generate(prompt, 1).prefill_us / 1e6

    def decode_seconds(self, prompt: Sequence[int], steps: int) -> float:
        """The engine's own time for ``steps`` tokens after the first (``context.decode_us`` over the
        ``gen_seq_len - 1`` tokens it decoded after ``prompt``, scaled to ``steps``)."""
        ctx = self._generate(prompt, steps + 1)
        made = ctx.gen_seq_len - 1
        if made < 1:
            raise WorkbenchError(f"MNN's engine stopped after {ctx.gen_seq_len} token(s); nothing was decoded")
        return ctx.decode_us / 1e6 * steps / made


class _EngineSteps:
    """One generation through the engine's KV cache: the prompt, then one token a step."""

    def __init__(self, lm: MnnLlm):
        self.lm = lm

    def start(self, prompt: list[int]) -> np.ndarray:
        self.lm.m.reset()
        return self.lm._forward(self.lm.m, prompt)[-1]

    def step(self, token: int, position: int) -> np.ndarray:
        return self.lm._forward(self.lm.m, [token])[-1]


def open_mnn_llm(folder: str | Path, *, threads: int | None = None) -> MnnLlm:
    return MnnLlm(folder, threads=threads)


def convert_mnn_llm(job) -> None:
    """The simulation as MNN's LLM directory (the plan's integers re-derived by MNN), scored by the engine."""
    prep, report = job.prep, job.report
    job.say("writing MNN's LLM model directory")
    t = time.perf_counter()
    info = write_mnn_llm_folder(prep.sim_lm, prep.qm, job.out, job.work / "mnn-llm")
    report.details["seconds"]["write"] = time.perf_counter() - t
    report.notes += info.pop("notes")
    report.details["mnn_llm"] = info
    runner = MnnLlm(job.out, threads=2)
    ev = job.evaluator()
    if ev is None:
        return
    ev.fill(report, ev.score(runner.logits, "mnn-llm"), job.out / "llm.mnn")
    ev.fill_decode(report, ev.score_decode(runner, "mnn-llm"), job.out / "llm.mnn")  # through the engine's cache
    prompt = list(ev.ids[:PROFILE_PROMPT].tolist())
    prefill = runner.prefill_seconds(prompt)
    decode = runner.decode_seconds(prompt, job.greedy_steps)
    report.details["runtime_speed"] = {
        "runtime": runner.runtime, "source": "the engine's own counters (context.prefill_us, context.decode_us)",
        "threads": runner.threads, "prompt_tokens": len(prompt), "prefill_ms": prefill * 1000,
        "prefill_tokens_per_second": len(prompt) / prefill, "decode_tokens_per_second": job.greedy_steps / decode,
        "load_seconds": runner.load_seconds}


TARGET = register_target(Target(
    "mnn-llm", "MNN-LLM", rules="mnn", convert=convert_mnn_llm, runnable=True, runner=open_mnn_llm, files=FILES,
    module=__name__,
    precision_note="MNN re-quantizes the simulated weights with one float scale and minimum per block, which "
                   "reproduces the plan's 4 and 8-bit grids; other widths are not carried"))
