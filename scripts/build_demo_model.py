"""Build the bundled demo model: corpus, tokenizer and a small Qwen3 trained from scratch.

Everything comes from text that ships with CPython (the reference-manual topics in
``pydoc_data`` and the docstrings of the standard library), so the build needs no network.

    python scripts/build_demo_model.py                 # ~15 min on 2 idle CPU cores
    python scripts/build_demo_model.py --steps 50      # quick smoke build

Writes ``assets/demo-model/`` (safetensors + config + tokenizer), and the held-out evaluation
and calibration texts beside it. Seeded: the same Python and torch give the same model.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "demo-model"
SKIP_DIRS = {"test", "tests", "site-packages", "ensurepip"}
EOS = "<|endoftext|>"


def stdlib_documents() -> list[str]:
    """Reference-manual topics plus one document per stdlib module (its docstrings)."""
    from pydoc_data.topics import topics

    docs = [topics[k].strip() for k in sorted(topics)]
    libdir = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(libdir.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(libdir).parts) or path.name == "topics.py":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) > 40:
                    parts.append(inspect.cleandoc(doc))
        if parts:
            docs.append("\n\n".join(parts))
    # de-duplicate while keeping order
    seen, unique = set(), []
    for d in docs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return unique


def split_documents(docs: list[str]) -> dict[str, list[str]]:
    """Stable split by content hash: 90% train, 5% held-out evaluation, 5% calibration."""
    out = {"train": [], "heldout": [], "calibration": []}
    for d in docs:
        h = int(hashlib.sha256(d.encode()).hexdigest(), 16) % 100
        out["heldout" if h < 5 else "calibration" if h < 10 else "train"].append(d)
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None,
                                   model_max_length=1 << 20)


def write_unigram_counts(tokenizer, train_docs: list[str], out: Path) -> None:
    """Token counts of the training text: the unigram baseline that ``bench/eval.py`` compares with."""
    counts = [0] * len(tokenizer)
    for d in train_docs:
        for i in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]:
            counts[i] += 1
    (out / "unigram_counts.json").write_text(json.dumps({"source": "training split", "counts": counts}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--counts-only", action="store_true",
                    help="only rewrite unigram_counts.json from the corpus with the existing tokenizer")
    args = ap.parse_args()
    if args.counts_only:
        from transformers import AutoTokenizer
        write_unigram_counts(AutoTokenizer.from_pretrained(args.out), split_documents(stdlib_documents())["train"],
                             args.out)
        return

    from transformers import Qwen3Config, Qwen3ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    docs = stdlib_documents()
    split = split_documents(docs)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters; "
          + ", ".join(f"{k} {len(v)}" for k, v in split.items()), flush=True)
    tokenizer = train_tokenizer(split["train"], args.vocab)

    ids = []
    for d in split["train"]:
        ids.extend(tokenizer(d)["input_ids"] + [tokenizer.eos_token_id])
    data = torch.tensor(ids, dtype=torch.long)
    print(f"train tokens: {len(data)}", flush=True)

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))) * 0.95 + 0.05)
    gen = torch.Generator().manual_seed(args.seed)
    ckpt = args.out.with_name(args.out.name + ".checkpoint.pt")
    start = 0
    if ckpt.is_file():  # resume an interrupted build exactly where it stopped
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        start = state["step"]
        print(f"resuming from step {start}", flush=True)
    model.train()
    for step in range(start, args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[s:s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - t0:6.0f} s", flush=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step + 1}, tmp)
            tmp.replace(ckpt)

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.to(torch.float16).save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "heldout.txt").write_text("\n\n".join(split["heldout"]) + "\n", encoding="utf-8")
    (args.out / "calibration.txt").write_text("\n\n".join(split["calibration"]) + "\n", encoding="utf-8")
    write_unigram_counts(tokenizer, split["train"], args.out)
    (args.out / "BUILD.json").write_text(json.dumps({
        "script": "scripts/build_demo_model.py", "args": {k: str(v) for k, v in vars(args).items()},
        "python": sys.version.split()[0], "torch": torch.__version__, "train_tokens": len(data),
        "parameters": n_params, "seconds": round(time.time() - t0, 1),
    }, indent=2) + "\n")
    ckpt.unlink(missing_ok=True)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
