"""Is the demo model real, and is the workbench's evaluation as fast as a plain loop?

    python bench/eval.py [--model demo] [--ctx 512] [--repeats 3]

Prints, on the bundled held-out text:
- the model's strided perplexity, the vocabulary size, and a unigram model's perplexity (token
  frequencies of the training text, add-one smoothed) on the same tokens;
- evaluation throughput (tokens/s, best of N after a warm-up) of ``workbench.evaluation.evaluate`` next to a
  plain transformers forward loop over the same windows (batch 1, labels, ``.loss``), and the ratio;
- a greedy generation sample.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from workbench import encode_text, evaluate, load_model, read_text
from workbench.evaluation.evaluate import strided_windows
from workbench.assets import demo_text_path


def unigram_perplexity(counts: list[int], ids: torch.Tensor, windows) -> float:
    total = sum(counts) + len(counts)
    logp = torch.tensor([math.log((c + 1) / total) for c in counts])
    scored = torch.cat([ids[w.score_from:w.end] for w in windows])
    return math.exp(-logp[scored].mean().item())


@torch.inference_mode()
def plain_loop(model, ids, windows) -> float:
    """The textbook loop: one window at a time, labels masked with -100, the model's own loss."""
    nll, n = 0.0, 0
    for w in windows:
        x = ids[w.begin:w.end][None]
        labels = x.clone()
        labels[:, : w.score_from - w.begin] = -100
        out = model(input_ids=x, labels=labels, use_cache=False)
        k = w.end - w.score_from
        nll += out.loss.item() * k
        n += k
    return math.exp(nll / n)


def best_of(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)

    lm = load_model(args.model)
    text_path = demo_text_path("heldout")
    ids = encode_text(lm.tokenizer, read_text(text_path))
    windows = strided_windows(len(ids), args.ctx)
    vocab = lm.config.vocab_size

    t_wb, report = best_of(lambda: evaluate(lm.model, ids, ctx=args.ctx, progress=False), args.repeats)
    t_plain, plain_ppl = best_of(lambda: plain_loop(lm.model, ids, windows), args.repeats)
    print(f"held-out text: {text_path.name}, {len(ids):,} tokens, {report.tokens:,} scored "
          f"({report.windows} windows of {args.ctx})")
    print(f"model perplexity      {report.perplexity:10.2f}   (plain loop: {plain_ppl:.2f})")
    print(f"vocabulary size / 4   {vocab / 4:10.2f}")
    counts_file = lm.path / "unigram_counts.json"
    if counts_file.is_file():
        uni = unigram_perplexity(json.loads(counts_file.read_text())["counts"], ids, windows)
        print(f"unigram perplexity    {uni:10.2f}   (model / unigram = {report.perplexity / uni:.3f})")
    else:
        print(f"unigram perplexity    n/a (no {counts_file.name} beside the model)")
    print(f"throughput workbench  {report.tokens / t_wb:10,.0f} tok/s  ({t_wb:.2f} s, best of {args.repeats})")
    print(f"throughput plain loop {report.tokens / t_plain:10,.0f} tok/s  ({t_plain:.2f} s, best of {args.repeats})")
    print(f"time ratio workbench / plain: {t_wb / t_plain:.3f} (target <= 1.10)")

    for prompt in ("If the argument is", "The os module", "Raise ValueError if"):
        x = lm.tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = lm.model.generate(**x, max_new_tokens=40, do_sample=False)
        print("greedy sample:", json.dumps(lm.tokenizer.decode(out[0])))


if __name__ == "__main__":
    main()
