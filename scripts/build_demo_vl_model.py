"""Build the bundled demo vision-language model: rendered pictures, questions and captions about them, and a
small Qwen2.5-VL trained from scratch to answer and caption them.

The pictures are drawn with PIL (one to four circles, squares or triangles of one colour, a single
shape on the left, right, top or bottom), so the build needs no network and no data set. The text
side reuses the demo text model's tokenizer with Qwen2.5-VL's image tokens added. Each training example
asks one of five things equally often: the caption (``CAPTION_PROMPT``, the prompt the workbench's
image-text matching uses), colour, shape, count or position; each example weighs the same in the loss.

    python scripts/build_demo_vl_model.py              # ~11 min on one busy CPU core
    python scripts/build_demo_vl_model.py --steps 40   # quick smoke build

Writes ``assets/demo-vl-model/`` (safetensors, config, tokenizer, preprocessor config, BUILD.json with
the held-out accuracy per question kind, caption accuracy and image-text matching accuracy) and ``assets/demo-vl/`` (held-out pictures with questions and captions, and
calibration pairs). Seeded: the same Python, Pillow and torch give the same model.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `make demo-vl-model` runs the script without the package installed
from workbench.evaluation.vision import CAPTION_PROMPT, VisionSample, image_text_matching  # noqa: E402
from workbench.model.load import load_model  # noqa: E402
from workbench.model.vision import answer_scorer  # noqa: E402

OUT = ROOT / "assets" / "demo-vl-model"
DATA = ROOT / "assets" / "demo-vl"
TEXT_TOKENIZER = ROOT / "assets" / "demo-model" / "tokenizer.json"
SIZE = 56  # pixels a side: 4x4 patches of 14, merged 2x2 into 4 image tokens
EOS = "<|endoftext|>"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 40, 170)}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three", "four")
POSITIONS = ("left", "right", "top", "bottom")
# Qwen2.5-VL's chat format, reduced to what the demo needs: the picture, then the question, then "Answer:" (Jinja's
# trim_blocks, which transformers sets, drops the newline after the tag: the prompt ends "...shape?Answer:")
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}\nAnswer:{% endif %}"
)


# -- pictures and questions ----------------------------------------------------------------------------------------

KINDS = ("colour", "shape", "count", "position")


def random_scene(rng: random.Random, count: int | None = None) -> dict:
    """What a picture shows: count, shape, colour and (for a single shape) where it is."""
    n = count or rng.randint(1, 4)
    return {"count": n, "shape": rng.choice(SHAPES), "colour": rng.choice(list(COLOURS)),
            "position": rng.choice(POSITIONS) if n == 1 else None}


def _centres(scene: dict, rng: random.Random) -> list[tuple[float, float, float]]:
    """(x, y, radius) of each shape; a single one inside its named half, several never overlapping."""
    if scene["count"] == 1:
        r = rng.uniform(6, 9)
        lo, hi, mid = r + 1, SIZE / 2 - 3, (SIZE / 2 - 6, SIZE / 2 + 6)
        x, y = rng.uniform(*mid), rng.uniform(*mid)
        if scene["position"] in ("left", "right"):
            x = rng.uniform(lo, hi)
            x = x if scene["position"] == "left" else SIZE - x
        else:
            y = rng.uniform(lo, hi)
            y = y if scene["position"] == "top" else SIZE - y
        return [(x, y, r)]
    while True:
        out = []
        for _ in range(200):
            r = rng.uniform(4.5, 6.5)
            x, y = rng.uniform(r + 1, SIZE - r - 1), rng.uniform(r + 1, SIZE - r - 1)
            if all(math.hypot(x - a, y - b) > r + c + 2 for a, b, c in out):
                out.append((x, y, r))
                if len(out) == scene["count"]:
                    return out


def render(scene: dict, rng: random.Random):
    """The picture of a scene: shapes on a light background of a random grey, colours jittered a little."""
    from PIL import Image, ImageDraw
    bg = rng.randint(215, 255)
    img = Image.new("RGB", (SIZE, SIZE), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    base = COLOURS[scene["colour"]]
    for x, y, r in _centres(scene, rng):
        fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in base)
        if scene["shape"] == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif scene["shape"] == "square":
            s = r * 0.9
            draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
        else:
            draw.polygon([(x, y - r), (x - r, y + r * 0.8), (x + r, y + r * 0.8)], fill=fill)
    return img


def questions(scene: dict) -> list[tuple[str, str, str]]:
    """(kind, question, answer) pairs a scene answers."""
    many = scene["count"] > 1
    out = [("colour", f"What colour {'are the shapes' if many else 'is the shape'}?", scene["colour"]),
           ("shape", f"What shape {'are they' if many else 'is it'}?", scene["shape"]),
           ("count", "How many shapes are there?", COUNTS[scene["count"] - 1])]
    if scene["position"]:
        out.append(("position", "Where is the shape?", scene["position"]))
    return out


def caption(scene: dict) -> str:
    """The scene in words: count, colour, shape and, for a single shape, where it is."""
    n = scene["count"]
    text = f"{COUNTS[n - 1]} {scene['colour']} {scene['shape']}{'s' if n > 1 else ''}"
    return text + (f" on the {scene['position']}" if scene["position"] in ("left", "right") else
                   f" at the {scene['position']}" if scene["position"] else "")


# -- tokenizer, processor, model -------------------------------------------------------------------------------------

def make_tokenizer():
    """The demo text model's BPE with Qwen2.5-VL's vision tokens and the chat template above."""
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TEXT_TOKENIZER), eos_token=EOS, pad_token=EOS, bos_token=None,
                                  model_max_length=1 << 20)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)


def make_config(tok):
    from transformers import Qwen2_5_VLConfig
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return Qwen2_5_VLConfig(
        vision_config=dict(depth=3, hidden_size=96, intermediate_size=256, num_heads=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, window_size=112,
                           fullatt_block_indexes=[0, 1, 2]),
        text_config=dict(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=None),
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"], tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)


def prompt_ids(tok, question: str, n_image_tokens: int) -> list[int]:
    """The chat-formatted prompt with the one ``<|image_pad|>`` repeated once per merged image token."""
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                   tokenize=False, add_generation_prompt=True)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_image_tokens)
    return tok(text, add_special_tokens=False)["input_ids"]


def _batched_vision_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kw):
    """Training only: every picture has the same size, so one batched attention call does what the per-image
    loop of transformers' SDPA path does (checked equal before training starts)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
    n_tok = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n_tok, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    n = len(cu_seqlens) - 1
    q, k, v = (t.reshape(n, n_tok // n, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)
    return self.proj(o.transpose(1, 2).reshape(n_tok, -1))


IMAGE_PAD_ID = None  # set in main from the tokenizer


def training_example(rng: random.Random, caption_share: float) -> tuple[dict, str, str, str]:
    """A fresh scene and one (kind, question, answer) about it: the caption with probability ``caption_share``,
    else a kind drawn uniformly from KINDS (a position question gets a single-shape scene); 0.2 asks all five
    kinds equally often."""
    if rng.random() < caption_share:
        scene = random_scene(rng)
        return scene, "caption", CAPTION_PROMPT, caption(scene)
    kind = rng.choice(KINDS)
    scene = random_scene(rng, 1 if kind == "position" else None)
    _, q, a = next(x for x in questions(scene) if x[0] == kind)
    return scene, kind, q, a


def make_batch(rng, tok, processor, n_image_tokens, batch, caption_share=0.0):
    """A batch of fresh pictures, one question each, right-padded; targets are the answer tokens and EOS."""
    images, seqs, answer_at = [], [], []
    for _ in range(batch):
        scene, _, q, a = training_example(rng, caption_share)
        images.append(render(scene, rng))
        p = prompt_ids(tok, q, n_image_tokens)
        ans = tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + ans)
        answer_at.append((len(p), len(ans)))
    width = max(map(len, seqs))
    ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    pix = processor(images, return_tensors="pt")
    pix["mm_token_type_ids"] = (ids == IMAGE_PAD_ID).long()  # what Qwen2.5-VL's processor gives: 3D positions
    # positions whose next token is an answer token: (row, position, target, weight); each example weighs the
    # same whatever its answer's length, so a caption's many tokens don't drown the one-word answers
    rows, pos, tgt, weight = [], [], [], []
    for i, (start, n) in enumerate(answer_at):
        for j in range(n):
            rows.append(i)
            pos.append(start + j - 1)
            tgt.append(seqs[i][start + j])
            weight.append(1.0 / (n * batch))
    return ids, mask, pix, (torch.tensor(rows), torch.tensor(pos), torch.tensor(tgt), torch.tensor(weight))


@torch.no_grad()
def answer(model, tok, processor, image, question: str, max_new_tokens: int = 6) -> str:
    """Greedy answer of a model to a question about a picture (transformers' generate)."""
    pix = processor([image], return_tensors="pt")
    n_image_tokens = int(pix["image_grid_thw"].prod()) // 4
    ids = torch.tensor([prompt_ids(tok, question, n_image_tokens)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix["pixel_values"],
                         image_grid_thw=pix["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_PAD_ID).long(), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def heldout_set(seed: int, n: int) -> list[dict]:
    """Held-out scenes from their own seed (the training pictures come from another stream), balanced over count."""
    rng = random.Random(seed + 1_000_003)
    scenes = []
    for i in range(n):
        s = random_scene(rng)
        s["count"] = i % 4 + 1
        s["position"] = rng.choice(POSITIONS) if s["count"] == 1 else None
        scenes.append((s, render(s, rng)))
    return scenes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--caption-share", type=float, default=0.2, help="share of training examples asking the caption")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: fastest for a model this small on shared cores; 0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=48, help="held-out pictures")
    ap.add_argument("--calibration", type=int, default=64, help="calibration picture-text pairs")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args()

    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    global IMAGE_PAD_ID
    tok, processor = make_tokenizer(), make_processor()
    IMAGE_PAD_ID = tok.convert_tokens_to_ids("<|image_pad|>")
    config = make_config(tok)
    model = Qwen2_5_VLForConditionalGeneration(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M (vocabulary {len(tok)})", flush=True)
    n_image_tokens = (SIZE // 14) ** 2 // 4
    rng = random.Random(args.seed)

    # the batched attention must give what transformers' own per-image loop gives
    ids, mask, pix, *_ = make_batch(random.Random(-1), tok, processor, n_image_tokens, 4)
    with torch.no_grad():
        ref = model.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"]).pooler_output
        for blk in model.model.visual.blocks:
            blk.attn.forward = types.MethodType(_batched_vision_attention, blk.attn)
        fast = model.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"]).pooler_output
    assert torch.allclose(ref, fast, atol=1e-5), "batched vision attention differs from transformers' own"

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))) * 0.95 + 0.05))
    model.train()
    running = None
    for step in range(args.steps):
        ids, mask, pix, (rows, pos, tgt, weight) = make_batch(rng, tok, processor, n_image_tokens, args.batch,
                                                      args.caption_share)
        hidden = model.model(input_ids=ids, attention_mask=mask, pixel_values=pix["pixel_values"],
                             image_grid_thw=pix["image_grid_thw"],
                             mm_token_type_ids=pix["mm_token_type_ids"]).last_hidden_state
        logits = model.lm_head(hidden[rows, pos])  # only where an answer token is predicted
        loss = (torch.nn.functional.cross_entropy(logits, tgt, reduction="none") * weight).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {running:.3f}  {time.time() - t0:6.0f} s", flush=True)
    train_seconds = time.time() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    for blk in model.model.visual.blocks:  # back to transformers' own attention
        del blk.attn.forward
    model.to(torch.float16).save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    processor.save_pretrained(args.out)

    # held-out pictures, questions and captions; calibration pairs
    if args.data.exists():
        shutil.rmtree(args.data)
    (args.data / "images").mkdir(parents=True)
    rows_q, rows_c, rows_cal = [], [], []
    for i, (scene, img) in enumerate(heldout_set(args.seed, args.heldout)):
        name = f"images/heldout-{i:03d}.png"
        img.save(args.data / name)
        rows_c.append({"image": name, "caption": caption(scene)})
        for kind, q, a in questions(scene):
            rows_q.append({"image": name, "question": q, "answer": a, "kind": kind})
    cal_rng = random.Random(args.seed + 2_000_003)
    for i in range(args.calibration):
        scene = random_scene(cal_rng)
        name = f"images/calibration-{i:03d}.png"
        render(scene, cal_rng).save(args.data / name)
        kind, q, a = cal_rng.choice(questions(scene))
        rows_cal.append({"image": name, "text": f"{q}\nAnswer: {a}", "question": q, "answer": a,
                         "caption": caption(scene)})
    for fname, rows in (("questions.jsonl", rows_q), ("captions.jsonl", rows_c), ("calibration.jsonl", rows_cal)):
        (args.data / fname).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    # accuracy of the saved (float16) checkpoint, reloaded by transformers' own class, computing in float32
    from PIL import Image
    saved = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32).eval()
    pictures = {}
    for r in rows_c:
        with Image.open(args.data / r["image"]) as im:
            pictures[r["image"]] = im.convert("RGB")
    right: dict[str, list[int]] = {}
    for r in rows_q:
        got = answer(saved, tok, processor, pictures[r["image"]], r["question"])
        right.setdefault(r["kind"], []).append(int(got == r["answer"]))
    captions_got = [answer(saved, tok, processor, pictures[r["image"]], CAPTION_PROMPT, max_new_tokens=16)
                    for r in rows_c]
    caption_accuracy = round(sum(g == r["caption"] for g, r in zip(captions_got, rows_c)) / len(rows_c), 3)
    lm = load_model(args.out)  # scored as the workbench scores every VLM: its own inputs, float32 compute
    itm = image_text_matching(answer_scorer(lm.model, lm.processor),
                              [VisionSample(pictures[r["image"]], CAPTION_PROMPT, r["caption"], r["image"])
                               for r in rows_c], distractors=3, seed=0)
    accuracy = {k: round(sum(v) / len(v), 3) for k, v in right.items()}
    overall = round(sum(map(sum, right.values())) / sum(map(len, right.values())), 3)
    chance = {"colour": 1 / len(COLOURS), "shape": 1 / len(SHAPES), "count": 1 / len(COUNTS),
              "position": 1 / len(POSITIONS)}
    # two different pictures, the same question: the answer must follow the picture
    a, b = ({"count": 1, "shape": "circle", "colour": "red", "position": "left"},
            {"count": 1, "shape": "square", "colour": "blue", "position": "right"})
    pair = [answer(saved, tok, processor, render(s, random.Random(7)), "What colour is the shape?") for s in (a, b)]
    print(f"held-out accuracy: {overall:.1%} overall; " +
          ", ".join(f"{k} {v:.1%} (chance {chance[k]:.0%})" for k, v in accuracy.items()), flush=True)
    print(f"a red circle -> {pair[0]!r}, a blue square -> {pair[1]!r}", flush=True)
    print(f"captions: {caption_accuracy:.1%} exact (e.g. {rows_c[0]['caption']!r} -> {captions_got[0]!r}); "
          f"image-text matching with 3 distractors: {itm.accuracy:.1%} (chance {itm.chance:.0%})", flush=True)
    (args.out / "BUILD.json").write_text(json.dumps({
        "script": "scripts/build_demo_vl_model.py",
        "args": {k: str(v.relative_to(ROOT)) if isinstance(v, Path) and v.is_relative_to(ROOT) else str(v)
                 for k, v in vars(args).items()},
        "python": sys.version.split()[0], "torch": torch.__version__, "parameters": n_params,
        "image_size": SIZE, "train_pictures": args.steps * args.batch, "train_seconds": round(train_seconds, 1),
        "seconds": round(time.time() - t0, 1),
        "heldout": {"pictures": args.heldout, "questions": len(rows_q), "accuracy": overall, "by_kind": accuracy,
                    "chance": {k: round(v, 3) for k, v in chance.items()}, "dtype": "float16 weights, float32 compute"},
        "captions": {"prompt": CAPTION_PROMPT, "pictures": len(rows_c), "exact_match": caption_accuracy,
                     "examples": {r["caption"]: g for r, g in list(zip(rows_c, captions_got))[:4]}},
        "image_text_matching": {"data": "captions.jsonl", "scorer": "workbench.model.vision.answer_scorer",
                                **{k: round(v, 3) if isinstance(v, float) else v for k, v in itm.to_dict().items()}},
        "two_pictures": {"red circle": pair[0], "blue square": pair[1]},
    }, indent=2) + "\n")
    print(f"wrote {args.out} and {args.data} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
