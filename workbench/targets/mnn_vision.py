"""The vision part of an ``mnn-llm`` folder: ``visual.mnn`` in the form MNN's engine (``omni.cpp``) feeds, and the
language model's 3-D (mrope) rotary positions the engine passes with an image.

    path = export_visual_onnx(vlm, "work/visual.onnx")          # patches, position_ids, attention_mask, window_index
    emb = run_visual_mnn("out/visual.mnn", pixel_values, grid_thw)    # MNN's own module, as the engine calls it

MNN 3.6's engine (``Omni::qwen2VisionProcess``) picks the Qwen2.5-VL form by the graph's input names: ``patches``
``[S, 3*2*14*14]`` (the image resized to ``image_size``, normalised by ``image_mean`` / ``image_norm``, duplicated in
time and cut into patches in the merge order transformers' processor uses), ``position_ids`` ``[2, S]`` (each patch's
row and column), ``attention_mask`` ``[2, 1, S, S]`` (0: all patches; 1: the 4 x 4 merged-patch windows),
``window_index`` ``[S/4]`` (the merged patches in window order); its output ``image_embeds`` ``[S/4, 1, hidden]``
replaces the ``image_pad`` tokens. The graph is written op by op (``onnx.build``) from the model's own modules,
each linear layer's output named after the layer so the plan's codes can be written into MNN's ops by name
(``mnn_llm.write_plan_codes``); the patch embedding, float in every plan, keeps float weights.

Scoring (``score_vision``, run by ``workbench convert``): the engine gets each held-out question as the float model's
prompt with ``<img>PATH</img>`` where its image tokens are (``EngineQuestion``), reads the picture itself, and its
answer-token logits are scored against the float model's and the simulation's (``engine_scorer``); ``visual.mnn``
alone is compared with the torch encoder (``visual_embedding_error``); the engine's own counters time the picture
path (``picture_timing``, also ``workbench profile``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import WorkbenchError
from ..evaluation.images import read_image
from ..evaluation.vision import (AnswerScores, answer_kl, capture_answer_reference, image_text_matching,
                                 itm_paired_difference)
from ..model.vision import VISION_MODEL_TYPES, answer_scorer, answer_text, is_vision_config, vision_inputs
from ..model.text_part import language_model
from ..model.vision_feed import embedding_error
from ..model.vision_quality import measure_vision_baseline, vision_eval_set
from ..onnx.build import INLINE_LIMIT, FloatWeights, GraphBuilder, TensorStore, as_array
from ..onnx.vision_export import gelu, vision_block

__all__ = ["VISUAL_FILE", "VISUAL_PREFIXES", "VISUAL_TYPES", "PartWeights", "text_view", "mrope_tables",
           "export_visual_onnx", "visual_inputs", "run_visual_mnn", "vision_llm_config", "engine_picture",
           "EngineQuestion", "engine_scorer", "visual_embedding_error", "noise_picture", "picture_timing",
           "greedy_answers", "decode_after_picture", "score_vision", "source_vision_inputs"]

VISUAL_FILE = "visual.mnn"
VISUAL_PREFIXES = ("model.visual.",)  # the vision layers' names in the plan
VISUAL_TYPES = ("qwen2_5_vl",)  # the VLMs whose vision encoder this module writes in MNN's form
ENGINE_IMAGE_SIZE = 420  # the square MNN's llmexport.py writes for Qwen2/2.5-VL (image_size) when the size is free
MERGE_WINDOW = 4  # merged patches a window side: MNN's engine fixes it (vit_merger_window_size), Qwen2.5-VL's 112 px


def text_view(model):
    """``model`` itself for a causal LM; its language model (``model.text_part.language_model``, its layers'
    names in the VLM under ``prefix``) for a VLM this target writes."""
    if getattr(model.config, "vision_config", None) is None:
        return model
    if model.config.model_type not in VISUAL_TYPES:
        raise WorkbenchError(f"mnn-llm writes the vision part of {', '.join(VISUAL_TYPES)} models, not "
                             f"'{model.config.model_type}'; use the mnn target for its language model")
    return language_model(model)


def mrope_tables(g: GraphBuilder, inv_freq: np.ndarray, sections) -> tuple[str, str]:
    """cos and sin ``[1, seq, 1, head_dim]`` from ``position_ids`` ``[3, seq]`` (time, height, width), as
    transformers' multimodal rotary computes them: frequency ``j`` turns with the row its section names
    (``mrope_section``). One ``[seq, 3] @ [3, d/2]`` product with one non-zero per column: each angle is the same
    single product ``position * inv_freq`` as the text rotary's."""
    half = len(inv_freq)
    if sum(sections) != half:
        raise WorkbenchError(f"mrope_section {list(sections)} does not cover the {half} rotary frequencies")
    select = np.zeros((3, half), np.float32)
    row = np.repeat(np.arange(3), sections)
    select[row, np.arange(half)] = inv_freq
    pos = g.op("Transpose", [g.op("Cast", ["position_ids"], to=1)], perm=[1, 0])  # [seq, 3]
    freqs = g.op("MatMul", [pos, g.const(select, np.float32)])  # [seq, d/2]
    emb = g.op("Concat", [freqs, freqs], axis=-1)
    return tuple(g.unsqueeze(g.op(f, [emb]), [0, 2]) for f in ("Cos", "Sin"))


def export_visual_onnx(vlm, path: str | Path) -> Path:
    """``vlm``'s vision encoder and merger as MNN's engine calls them (module docstring), as an ONNX graph at
    ``path``. Linear layers carry the model's values (the simulation's dequantized ones for a plan)."""
    from onnx import TensorProto, helper

    visual, vc = vlm.model.visual, vlm.config.vision_config
    if vlm.config.model_type not in VISUAL_TYPES:
        raise WorkbenchError(f"mnn-llm writes the vision part of {', '.join(VISUAL_TYPES)}, not "
                             f"'{vlm.config.model_type}'")
    if vc.window_size // vc.spatial_merge_size // vc.patch_size != MERGE_WINDOW or vc.spatial_merge_size != 2:
        raise WorkbenchError(f"MNN's engine cuts windows of {MERGE_WINDOW} merged 2 x 2 patches; this model's window "
                             f"is {vc.window_size} px of {vc.patch_size} px patches merged {vc.spatial_merge_size}: "
                             "its vision part cannot run there")
    if str(vc.hidden_act) not in ("silu", "swish"):
        raise WorkbenchError(f"the vision blocks use '{vc.hidden_act}', not SiLU: not written for MNN")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = TensorStore(path.parent, INLINE_LIMIT)
    policy = FloatWeights()
    g = GraphBuilder(store, 17, None)
    dim, heads = vc.hidden_size, vc.num_heads
    hd = dim // heads
    full = set(vc.fullatt_block_indexes)

    def linear(module, fqn: str, x: str) -> str:
        policy.linear(g, module, fqn, x)
        g.nodes[-1].output[0] = fqn  # MNN names the op after it: the plan's codes are found by it
        return fqn

    try:
        with torch.no_grad():
            conv = visual.patch_embed.proj.weight  # [dim, C, T, P, P]: the patches' own order, flattened
            # [1, K, N]: a batched constant MatMul weight, which MNN's weight quantization leaves float
            w = g.weight("model.visual.patch_embed.proj.weight.T",
                         lambda: as_array(conv.reshape(conv.shape[0], -1).T)[None])
            h = g.reshape(g.op("MatMul", ["patches", w]), [-1, dim])  # [S, dim]
            order = g.op("Cast", ["window_index"], to=TensorProto.INT64)
            # positions and patches in window order, merged 2 x 2 groups kept whole
            pos = g.op("Cast", ["position_ids"], to=1)
            pos = g.reshape(g.op("Gather", [g.reshape(pos, [2, -1, 4]), order], axis=1), [2, -1])
            inv = as_array(visual.rotary_pos_emb.inv_freq)  # [hd/4]
            freqs = g.op("Mul", [g.unsqueeze(g.op("Transpose", [pos], perm=[1, 0]), [2]), g.const(inv, np.float32)])
            freqs = g.reshape(freqs, [-1, 2 * len(inv)])  # [S, hd/2]: rows' angles, then columns'
            emb = g.op("Concat", [freqs, freqs], axis=-1)
            cos, sin = (g.unsqueeze(g.op(f, [emb]), [0]) for f in ("Cos", "Sin"))  # [1, S, hd]
            h = g.reshape(g.op("Gather", [g.reshape(h, [-1, 4, dim]), order], axis=0), [-1, dim])
            masks = {i: g.op("Gather", ["attention_mask", g.const(i)], axis=0) for i in (0, 1)}  # [1, S, S]
            for i, block in enumerate(visual.blocks):
                h = vision_block(g, linear, block, i, h, cos, sin, masks[0 if i in full else 1], -1, heads, hd)
            g.scope = "model.visual.merger"
            merger = visual.merger
            x = g.reshape(g.rms_norm(h, merger.ln_q, "model.visual.merger.ln_q"), [-1, 4 * dim])
            x = gelu(g, linear(merger.mlp[0], "model.visual.merger.mlp.0", x))
            g.scope = "model.visual.merger"
            x = linear(merger.mlp[2], "model.visual.merger.mlp.2", x)
            # back to raster order: out[window_index[j]] = x[j]
            n = g.op("Shape", ["window_index"])
            rank = g.op("Range", [g.const(0), g.op("Squeeze", [n, g.const([0])]), g.const(1)])
            back = g.op("ScatterElements", [rank, order, rank], axis=0)
            g.op("Unsqueeze", [g.op("Gather", [x, back], axis=0), g.const([1])], name="image_embeds_node")
            g.nodes[-1].output[0] = "image_embeds"
        store.close()
        seq = "patches"
        inputs = [helper.make_tensor_value_info("patches", TensorProto.FLOAT, [seq, conv[0].numel()]),
                  helper.make_tensor_value_info("position_ids", TensorProto.INT32, [2, seq]),
                  helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [2, 1, seq, seq]),
                  helper.make_tensor_value_info("window_index", TensorProto.INT32, ["merged"])]
        outputs = [helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, ["merged", 1, vc.out_hidden_size])]
        graph = helper.make_graph(g.nodes, "visual", inputs, outputs,
                                  list(g.constants.values()) + [store.proto(w) for w in g.weights])
        proto = helper.make_model(graph, producer_name="workbench", opset_imports=[helper.make_opsetid("", 17)])
        proto.ir_version = min(proto.ir_version, 10)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(proto.SerializeToString())
        os.replace(tmp, path)
    finally:
        store.close()
    return path


def visual_inputs(pixel_values, grid_thw) -> list[np.ndarray]:
    """The four inputs MNN's engine builds for a picture (``qwen2VisionProcess``), from the patches transformers'
    processor made (the same ``[S, 1176]`` order) and its ``[t, h, w]`` grid: one picture, all in numpy."""
    t, h, w = (int(x) for x in np.asarray(grid_thw).reshape(-1)[:3])
    seq = t * h * w
    hpos = np.arange(h)[:, None].repeat(w, 1).reshape(h // 2, 2, w // 2, 2).transpose(0, 2, 1, 3).reshape(-1)
    wpos = np.arange(w)[None, :].repeat(h, 0).reshape(h // 2, 2, w // 2, 2).transpose(0, 2, 1, 3).reshape(-1)
    position_ids = np.tile(np.stack([hpos, wpos]), (1, t)).astype(np.int32)
    lh, lw = h // 2, w // 2
    nh = (lh + MERGE_WINDOW - lh % MERGE_WINDOW) // MERGE_WINDOW  # the engine pads a whole window when divisible
    nw = (lw + MERGE_WINDOW - lw % MERGE_WINDOW) // MERGE_WINDOW
    index, lengths = [], []
    for ti in range(t):
        for wh in range(nh):
            for ww in range(nw):
                cells = [ti * lh * lw + y * lw + x for y in range(wh * MERGE_WINDOW, min((wh + 1) * MERGE_WINDOW, lh))
                         for x in range(ww * MERGE_WINDOW, min((ww + 1) * MERGE_WINDOW, lw))]
                index += cells
                lengths.append(len(cells))
    mask = np.zeros((2, 1, seq, seq), np.float32)
    mask[1] = np.finfo(np.float32).min
    start = 0
    for n in lengths:
        end = start + 4 * n
        mask[1, 0, start:end, start:end] = 0
        start = end
    patches = np.ascontiguousarray(np.asarray(pixel_values, np.float32).reshape(seq, -1))
    return [patches, position_ids, mask, np.asarray(index, np.int32)]


def run_visual_mnn(path: str | Path, pixel_values, grid_thw) -> np.ndarray:
    """``visual.mnn`` run by MNN's own module loader (what the engine loads it with) on one picture's patches;
    ``[S/4, hidden]``."""
    import MNN.expr as F
    import MNN.nn as nn
    names = ["patches", "position_ids", "attention_mask", "window_index"]
    module = nn.load_module_from_file(str(path), names, ["image_embeds"])
    feeds = []
    for a in visual_inputs(pixel_values, grid_thw):
        v = F.placeholder(list(a.shape), F.NCHW, F.int if a.dtype == np.int32 else F.float)
        v.write(a.reshape(-1).tolist() if a.dtype == np.int32 else a)
        feeds.append(v)
    out = module.forward(feeds)
    out = out[0] if isinstance(out, (list, tuple)) else out
    return np.array(out.read(), dtype=np.float32).reshape(-1, out.shape[-1])


def vision_llm_config(vlm, image_processor) -> dict:
    """The ``llm_config.json`` keys MNN's engine reads for pictures (``Omni::Omni``): the image token ids, the
    square size a picture is resized to (the processor's fixed pixel count; the engine rounds it to 28), and the
    processor's normalisation as the engine applies it to 0-255 pixels (``(x - mean) * norm``)."""
    cfg, ip = vlm.config, image_processor
    size = getattr(ip, "size", None) or {}
    lo = int(getattr(ip, "min_pixels", None) or size.get("shortest_edge") or 56 * 56)
    hi = int(getattr(ip, "max_pixels", None) or size.get("longest_edge") or lo)
    # a fixed pixel count (the demo VLM's) is its square; a range gets llmexport's 420 px, kept within it
    side = int(round(lo ** 0.5)) if lo == hi else int(min(max(ENGINE_IMAGE_SIZE, lo ** 0.5), hi ** 0.5))
    mean, std = np.asarray(ip.image_mean, np.float64), np.asarray(ip.image_std, np.float64)
    return {"is_visual": True, "image_size": side, "vision_start": int(cfg.vision_start_token_id),
            "vision_end": int(cfg.vision_end_token_id), "image_pad": int(cfg.image_token_id),
            "image_mean": (mean * 255).tolist(), "image_norm": (1 / (std * 255)).tolist()}


class PartWeights:
    """The quantized model ``qm`` restricted to the layers under ``prefixes`` (one graph's: ``visual.mnn`` or
    ``llm.mnn``), with what ``plan_codes_layout``, ``write_plan_codes`` and ``mnn_weight_args`` read."""

    def __init__(self, qm, prefixes: tuple[str, ...], keep: bool = True):
        inside = (lambda n: n.startswith(prefixes)) if keep else (lambda n: not n.startswith(prefixes))
        self.qm, self.plan = qm, qm.plan
        self.weights = {n: q for n, q in qm.weights.items() if inside(n)}
        self.layers = [r for r in qm.layers if inside(r.name)]

    def layer(self, name: str):
        return self.qm.layer(name)

    def __getattr__(self, name):
        return getattr(self.qm, name)


def engine_picture(image, size: int, folder: Path) -> Path:
    """``image`` (a path or a PIL image) as a PNG of the engine's square ``size`` in ``folder``, resized as the
    float model's processor resizes (bicubic) so the engine's own resize is the identity and both see one picture."""
    from PIL import Image
    img = read_image(image) if isinstance(image, (str, Path)) else image.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.BICUBIC)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"picture-{len(list(folder.glob('picture-*.png')))}.png"
    img.save(path)
    return path.resolve()


class EngineQuestion:
    """One picture and question as MNN's engine gets it: the prompt text with ``<img>PATH</img>`` where the
    float model's prompt has its image tokens, the transformers ids the engine's must equal, and the picture."""

    def __init__(self, processor, image, question: str, size: int, folder: Path, answer: str | None = None):
        tok = processor.tokenizer
        picture = engine_picture(image, size, folder)
        if "</img>" in str(picture):
            raise WorkbenchError(f"the picture's path '{picture}' holds '</img>', which ends MNN's image tag")
        from PIL import Image
        feats = processor(Image.open(picture).convert("RGB"), question)
        self.ids = feats["input_ids"][0].tolist()
        prompt = processor.prompt_text(question)
        tag = "<|vision_start|>" + processor.image_token + "<|vision_end|>"
        if prompt.count(tag) != 1:
            raise WorkbenchError(f"the prompt does not hold '{tag}' once: MNN's engine cannot place the picture")
        self.text = prompt.replace(tag, f"<img>{picture}</img>")
        self.answer: list[int] = []
        if answer is not None:
            extra = answer_text(self.ids, answer, tok)
            self.answer = tok(extra, add_special_tokens=False)["input_ids"]
            self.text += extra
            self.ids += self.answer
        self.feats, self.picture = feats, picture


def engine_scorer(runner, processor, size: int, folder: Path):
    """A scorer for ``workbench.evaluation.vision`` (``answer_kl``, ``image_text_matching``) whose answer
    log-probabilities come from MNN's engine reading the picture itself (``runner.image_logits``); the engine's
    ids must equal the float model's (same prompt, image tokens, answer), else the scores would not be paired."""
    def score(sample) -> AnswerScores:
        q = EngineQuestion(processor, sample.image, sample.prompt, size, folder, sample.answer)
        ids, logits = runner.image_logits(q.text)
        if list(ids) != q.ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, q.ids)) if a != b), min(len(ids), len(q.ids)))
            raise WorkbenchError(f"MNN's engine made {len(ids)} ids of the prompt where transformers made "
                                 f"{len(q.ids)} (first difference at {at}): its tokenizer.txt or image settings are "
                                 "not this model's; convert it again")
        n = len(q.answer)
        rows = torch.from_numpy(np.ascontiguousarray(logits[-(n + 1):-1]))
        return AnswerScores(torch.log_softmax(rows.float(), dim=-1), torch.tensor(q.answer))

    return score


def visual_embedding_error(visual_file: Path, vlm, processor, images, size: int, folder: Path) -> dict:
    """``visual.mnn`` (MNN's module loader, the engine's patches) against ``vlm``'s vision encoder in torch on the
    same pictures, by ``model.vision_feed.embedding_error``."""
    got, want = [], []
    for image in images:
        q = EngineQuestion(processor, image, "?", size, folder)
        pv, grid = q.feats["pixel_values"], q.feats["image_grid_thw"]
        with torch.no_grad():
            ref = vlm.model.visual(pv, grid_thw=grid)
        ref = getattr(ref, "pooler_output", ref)
        want.append(ref.float().numpy().reshape(-1, ref.shape[-1]))
        got.append(run_visual_mnn(visual_file, pv.numpy(), grid.numpy()))
    return embedding_error(got, want)


def noise_picture(size: int, folder: Path) -> Path:
    """A fixed pseudo-random RGB picture of the engine's size (the encoder's time depends on the size only)."""
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"noise-{size}.png"
    if not path.is_file():
        rgb = np.random.default_rng(0).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(rgb, "RGB").save(path)
    return path.resolve()


def picture_timing(runner, text: str, steps: int, repeats: int) -> dict:
    """The engine's own counters for a prompt with a picture, after one warm-up: the median of ``repeats`` runs of
    the encoder (``vision_us``: reading, resizing, encoding the picture), the prefill of the prompt with the
    picture's tokens (``prefill_us``) and the decode of ``steps`` tokens after it (``decode_us``). The encoder and
    prefill come from runs that stop at the first token, one after another at one prompt length, as the text
    prefill is timed (a decode between two prompts makes the engine plan its graphs again for the prompt's
    shape: tens of milliseconds on the demo VLM, which a chat pays once per turn but is not the prefill's cost)."""
    runner.image_generate(text, 1)
    firsts = [runner.image_generate(text, 1) for _ in range(max(1, repeats))]
    runner.image_generate(text, steps + 1)
    runs = [runner.image_generate(text, steps + 1) for _ in range(max(1, repeats))]
    if min(r.gen_seq_len for r in runs) < 2:
        raise WorkbenchError("MNN's engine stopped after the first token of a prompt with a picture; nothing was "
                             "decoded")
    med = lambda values: float(np.median(list(values)))  # noqa: E731
    encoder, prefill = med(r.vision_us for r in firsts) / 1000, med(r.prefill_us for r in firsts) / 1000
    per_token_us = med(r.decode_us / (r.gen_seq_len - 1) for r in runs)
    return {"source": "the engine's own counters (context.vision_us, prefill_us, decode_us)",
            "prompt_tokens": int(firsts[0].prompt_len), "encoder_ms": encoder, "prefill_ms": prefill,
            "first_token_ms": encoder + prefill, "decode_tokens_per_second": 1e6 / per_token_us,
            "decoded_tokens": int(min(r.gen_seq_len for r in runs) - 1), "runs": len(runs)}


def greedy_answers(runner, processor, model, questions, size: int, folder: Path, new_tokens: int) -> dict:
    """The engine's own greedy answers (its generate: prefill with the picture, then its decode positions) against
    ``model``'s greedy answers in transformers, question by question, each up to its end-of-text token or
    ``new_tokens`` tokens: the fraction answered the same, token for token."""
    stop = set(processor.tokenizer.all_special_ids) | {processor.tokenizer.eos_token_id}
    cut = lambda ts: [t for t in ts[:next((i for i, t in enumerate(ts) if t in stop), len(ts))]]  # noqa: E731
    same = 0
    for s in questions:
        q = EngineQuestion(processor, s.image, s.prompt, size, folder)
        got = cut(list(runner.image_generate(q.text, new_tokens).tokens))
        with torch.inference_mode():
            ref = model.generate(**q.feats, max_new_tokens=new_tokens, do_sample=False)[0, len(q.ids):].tolist()
        same += got == cut(ref)
    return {"questions": len(questions), "same_answer": same / max(len(questions), 1), "new_tokens": new_tokens}


def decode_after_picture(runner, processor, questions, size: int, folder: Path) -> dict:
    """The engine's decode steps after a picture against its own prefill of the same tokens, teacher-forced: each
    answer token fed one at a time through its KV cache (its decode positions, ``all_seq_len + i``) against the
    same tokens in one prompt (its prefill: transformers' 3-D positions, which the simulation matches). What the
    engine's decode positions alone change: KL and top-1 of the predictions after each answer token."""
    kls, same = [], []
    for s in questions:
        q = EngineQuestion(processor, s.image, s.prompt, size, folder, s.answer)
        n = len(q.answer)
        _, full = runner.image_logits(q.text)
        steps, prompt = runner.picture_steps(processor, s.image, s.prompt)
        steps.start(prompt)
        rows = [steps.step(t, len(prompt) + i) for i, t in enumerate(q.answer)]
        ref = torch.log_softmax(torch.from_numpy(np.ascontiguousarray(full[-n:])).float(), -1)
        got = torch.log_softmax(torch.from_numpy(np.stack(rows)).float(), -1)
        kls += (ref.exp() * (ref - got)).sum(-1).tolist()
        same += (ref.argmax(-1) == got.argmax(-1)).tolist()
    return {"questions": len(questions), "steps": len(kls), "kl_vs_prefill": float(np.mean(kls)),
            "top1_vs_prefill": float(np.mean(same))}


def score_vision(job, runner, *, images=None) -> dict:
    """A VL folder's picture path scored and timed in MNN's engine, into the report: the answer-token KL and
    top-1 against the float model (and against the simulation: what the engine adds) with the engine reading each
    held-out picture itself, image-text matching accuracy beside the float model's, ``visual.mnn``'s image
    embeddings against the float encoder's, and the engine's encoder / prefill / decode times."""
    prep, report = job.prep, job.report
    lm = prep.float_lm
    images = images or vision_eval_set()
    size = int(json.loads((job.out / "llm_config.json").read_text(encoding="utf-8"))["image_size"])
    pictures = job.work / "pictures"
    job.say(f"scoring the picture path in MNN's engine on {images.describe()}")
    t = time.perf_counter()
    baseline = measure_vision_baseline(lm, images)
    score = engine_scorer(runner, lm.processor, size, pictures)
    kl = answer_kl(score, images.questions, reference=baseline.answers)
    sim_ref = capture_answer_reference(answer_scorer(prep.sim_lm.model, lm.processor), images.questions)
    kl_sim = answer_kl(score, images.questions, reference=sim_ref)
    out = {"questions": len(images.questions), "answer_tokens": kl.tokens, "answer_kl": kl.kl_divergence,
           "answer_kl_stderr": kl.kl_stderr, "answer_top1": kl.top1_agreement,
           "answer_kl_vs_simulation": kl_sim.kl_divergence, "answer_top1_vs_simulation": kl_sim.top1_agreement,
           "source": images.source}
    if baseline.matching is not None:
        itm = image_text_matching(score, images.captions, distractors=baseline.distractors)
        diff = itm_paired_difference(itm, baseline.matching)
        out.update(itm_accuracy=itm.accuracy, reference_itm_accuracy=baseline.matching.accuracy,
                   itm_difference=diff["mean"], itm_difference_stderr=diff["stderr"], distractors=baseline.distractors)
    distinct = list(dict.fromkeys(str(q.image) for q in images.questions if isinstance(q.image, (str, Path))))
    visual_file = job.out / VISUAL_FILE
    out["embeddings_vs_float"] = visual_embedding_error(visual_file, lm.model, lm.processor, distinct, size, pictures)
    out["embeddings_vs_simulation"] = visual_embedding_error(visual_file, prep.sim_lm.model, lm.processor, distinct,
                                                             size, pictures)
    out["greedy_vs_simulation"] = greedy_answers(runner, lm.processor, prep.sim_lm.model, images.questions, size,
                                                 pictures, 8)
    out["decode_after_picture"] = decode_after_picture(runner, lm.processor, images.questions, size, pictures)
    out["seconds"] = time.perf_counter() - t
    first = EngineQuestion(lm.processor, images.questions[0].image, images.questions[0].prompt, size, pictures)
    out["speed"] = picture_timing(runner, first.text, job.greedy_steps, 3)
    report.details["mnn_llm_vision"] = out
    e, sp = out["embeddings_vs_float"], out["speed"]
    report.notes.append(
        f"picture path in MNN's engine ({out['questions']} questions): answer KL {kl.kl_divergence:.4f} "
        f"+/- {kl.kl_stderr:.4f}, top-1 {kl.top1_agreement:.3f} vs float (KL {kl_sim.kl_divergence:.2g} vs the "
        f"simulation), greedy answers equal to the simulation's {out['greedy_vs_simulation']['same_answer']:.3f}, "
        f"its decode after the picture vs its prefill KL {out['decode_after_picture']['kl_vs_prefill']:.2g}; "
        f"visual.mnn embeddings cosine {e['cosine']:.4f}, relative error {e['relative_error']:.4f}; "
        f"encoder {sp['encoder_ms']:.2f} ms, prefill {sp['prefill_ms']:.2f} ms ({sp['prompt_tokens']} tokens), "
        f"decode {sp['decode_tokens_per_second']:.0f} tok/s")
    return out


def source_vision_inputs(source: Path, tokenizer):
    """The picture-and-question preprocessing (``VisionInputs``) of the float VLM in ``source`` (a converted
    folder's source model), or None for a text model: what a runtime that reads pictures itself is asked with."""
    from transformers import AutoConfig
    try:
        raw = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not is_vision_config(raw) or raw.get("model_type") not in VISION_MODEL_TYPES:
        return None
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    return vision_inputs(VISION_MODEL_TYPES[raw["model_type"]][1], Path(source), config, tokenizer)
