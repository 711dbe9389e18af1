"""Speed, size and memory of every exported or converted model below a directory, on this CPU.

    workbench profile out/convert
    workbench profile out/onnx --prompt-lengths 16,64,256 --threads 2 --json

Each decode speed is also shown as a fraction of this host's bound: its read bandwidth (measured once, one
thread, cached in the workspace) over the bytes of the decode graph, the same reading as a device
projection's efficiency (`workbench project`). A vision-language model folder (float, or `workbench quantize`'s
output) is run by torch: its vision encoder per image, the first token with the image's tokens, decode tokens/s.

    workbench profile assets/demo-vl-model --image 56x56
"""
from __future__ import annotations

from ..run.profile import (DEFAULT_PROMPT_LENGTHS, host_bandwidth, is_vision_folder, last_level_cache_bytes,
                           parse_prompt_lengths, profile_directory, profile_vision_model)
from ..devices.vision_projection import parse_image_size
from ..units import format_bytes
from ..errors import WorkbenchError
from .common import count, thread_count, add_json_flag, print_json
from ..files.workspace import Workspace

HELP = "prefill latency, decode tokens/s, size and memory of exported / converted models (this CPU)"


def add_arguments(p):
    p.add_argument("directory", help="output of `workbench export` or `workbench convert` (searched recursively)")
    p.add_argument("--prompt-lengths", default=",".join(map(str, DEFAULT_PROMPT_LENGTHS)),
                   help="prompt lengths to time prefill at (default %(default)s)")
    p.add_argument("--decode-steps", type=count(1), default=32, help="decode steps timed per repeat (default 32)")
    p.add_argument("--repeats", type=count(1), default=5, help="timed repeats after one warm-up; the median is kept")
    p.add_argument("--threads", type=thread_count(), default=1,
                   help="runtime threads, at most the CPU cores (default 1)")
    p.add_argument("--vocab-size", type=count(2), help="token ids are drawn below this (default 1000)")
    p.add_argument("--workspace", help="workspace holding the cached host bandwidth (default ./workspace or "
                   "$WORKBENCH_WORKSPACE)")
    p.add_argument("--measure-bandwidth", action="store_true", help="measure this host's read bandwidth again "
                   "instead of using the cached figure")
    p.add_argument("--image", help="a vision-language model's picture size WIDTHxHEIGHT (default: the size its family "
                   "is exported at; the processor's own where it fixes the pixel count)")
    add_json_flag(p)


def _run_vision(args) -> int:
    vp = profile_vision_model(args.directory, image_size=parse_image_size(args.image) if args.image else None,
                              decode_steps=args.decode_steps, repeats=args.repeats, threads=args.threads)
    if args.json:
        print_json({"vision_profile": vp.to_dict()})
        return 0
    print(f"{vp.name} ({vp.runtime}, {format_bytes(vp.size_bytes)})")
    print(f"  image            {vp.image[0]}x{vp.image[1]}: {vp.image_tokens} image tokens in a {vp.prompt_tokens}-token prompt")
    print(f"  vision encoder   {vp.encoder_ms:.1f} ms per image")
    print(f"  first token      {vp.first_token_ms:.1f} ms (encoder + prefill of prompt and image tokens "
          f"{vp.prefill_ms:.1f} ms)")
    print(f"  decode           {vp.decode_tokens_per_second:.0f} tok/s")
    print(f"\nmedian of {args.repeats} runs after a warm-up, {args.threads} thread(s), on this machine's CPU")
    for n in vp.notes:
        print(f"  note: {n}")
    return 0


def run(args) -> int:
    if is_vision_folder(args.directory):
        return _run_vision(args)
    if args.image:
        raise WorkbenchError(f"--image: '{args.directory}' is not a vision-language model folder")
    profiles = profile_directory(args.directory, prompt_lengths=parse_prompt_lengths(args.prompt_lengths),
                                 decode_steps=args.decode_steps, repeats=args.repeats, threads=args.threads,
                                 vocab_size=args.vocab_size)
    host = host_bandwidth(Workspace(args.workspace) if args.workspace else None, force=args.measure_bandwidth)
    gbps = host["read_gbps"]
    if args.json:
        print_json({"host_bandwidth": host,
                    "profiles": [{**p.to_dict(), "decode_bound_tps": p.decode_bound(gbps),
                                  "fraction_of_bound": p.fraction_of_bound(gbps)} for p in profiles]})
        return 0
    lengths = sorted({n for p in profiles for n in p.prefill_ms})
    print(f"{'model':<24}{'runtime':<19}{'size':>10}" + "".join(f"{f'prefill {n} ms':>16}" for n in lengths)
          + f"{'decode tok/s':>14}{'bound':>8}{'of bound':>9}{'+RSS MB':>9}")
    for p in profiles:
        cells = "".join(f"{p.prefill_ms[n]:>16.1f}" if n in p.prefill_ms else f"{'-':>16}" for n in lengths)
        dec = f"{p.decode_tokens_per_second:>14.0f}" if p.decode_tokens_per_second else f"{'-':>14}"
        bound = p.decode_bound(gbps) if p.decode_tokens_per_second else None
        frac = p.fraction_of_bound(gbps)
        dec += (f"{bound:>8.0f}" if bound else f"{'-':>8}") + (f"{frac:>9.2f}" if frac is not None else f"{'-':>9}")
        mem = f"{p.rss_added_mb:>9.0f}" if p.rss_added_mb is not None else f"{'-':>9}"
        print(f"{p.name:<24}{p.runtime:<19}{format_bytes(p.size_bytes):>10}{cells}{dec}{mem}")
        if p.vision:
            print(f"  {p.vision_summary()}")
        for note in p.notes:
            print(f"  note: {note}")
        if frac is not None and frac > 1:
            cache = last_level_cache_bytes()
            print(f"  note: faster than the memory bound: " + (
                f"its {format_bytes(p.decode_bytes)} decode graph fits in this CPU's {format_bytes(cache)} "
                "last-level cache, so it is not read from memory each step" if cache and p.decode_bytes <= cache else
                "the runtime reads faster than one thread's reduction over a buffer (the bound's measurement)"))
    print(f"\nmedian of {args.repeats} runs after a warm-up, {args.threads} thread(s), on this machine's CPU")
    print(f"bound: this host's read bandwidth {gbps:.1f} GB/s (one thread, measured {host['measured']}, cached in "
          f"{host['artifact']}; --measure-bandwidth measures again) / the bytes one decode step reads (the decode "
          "graph's weights, an embedding table's one row)")
    return 0
