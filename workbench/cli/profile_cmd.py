"""Speed, size and memory of every exported or converted model below a directory, on this CPU.

    workbench profile out/convert
    workbench profile out/onnx --prompt-lengths 16,64,256 --threads 2 --json
"""
from __future__ import annotations

from ..profile import DEFAULT_PROMPT_LENGTHS, parse_prompt_lengths, profile_directory
from .common import add_json_flag, format_bytes, print_json

HELP = "prefill latency, decode tokens/s, size and memory of exported / converted models (this CPU)"


def add_arguments(p):
    p.add_argument("directory", help="output of `workbench export` or `workbench convert` (searched recursively)")
    p.add_argument("--prompt-lengths", default=",".join(map(str, DEFAULT_PROMPT_LENGTHS)),
                   help="prompt lengths to time prefill at (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per repeat (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats after one warm-up; the median is kept")
    p.add_argument("--threads", type=int, default=1, help="runtime threads (default 1)")
    p.add_argument("--vocab-size", type=int, help="token ids are drawn below this (default 1000)")
    add_json_flag(p)


def run(args) -> int:
    profiles = profile_directory(args.directory, prompt_lengths=parse_prompt_lengths(args.prompt_lengths),
                                 decode_steps=args.decode_steps, repeats=args.repeats, threads=args.threads,
                                 vocab_size=args.vocab_size)
    if args.json:
        print_json({"profiles": [p.to_dict() for p in profiles]})
        return 0
    lengths = sorted({n for p in profiles for n in p.prefill_ms})
    print(f"{'model':<24}{'runtime':<13}{'size':>10}" + "".join(f"{f'prefill {n} ms':>16}" for n in lengths)
          + f"{'decode tok/s':>14}{'+RSS MB':>9}")
    for p in profiles:
        cells = "".join(f"{p.prefill_ms[n]:>16.1f}" if n in p.prefill_ms else f"{'-':>16}" for n in lengths)
        dec = f"{p.decode_tokens_per_second:>14.0f}" if p.decode_tokens_per_second else f"{'-':>14}"
        mem = f"{p.peak_rss_added_mb:>9.0f}" if p.peak_rss_added_mb is not None else f"{'-':>9}"
        print(f"{p.name:<24}{p.runtime:<13}{format_bytes(p.size_bytes):>10}{cells}{dec}{mem}")
        for note in p.notes:
            print(f"  note: {note}")
    print(f"\nmedian of {args.repeats} runs after a warm-up, {args.threads} thread(s), on this machine's CPU")
    return 0
