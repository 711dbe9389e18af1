"""Project a model and plan onto a device: memory fit, decode tokens/s and prefill bounds, before flashing it.

    workbench project qwen2.5-1.5b --device 8gen3 --bits 8 --embeddings int8
    workbench project ./Qwen2.5-7B/config.json --device rk3588 --plan plan.json --context 2048 --json
    workbench project qwen3-1.7b --device rk3588 --bits 8 --claim-decode 22 --claim-peak-gb 1.8
    workbench project qwen3-4b --device 8elite --runtime genie --context 4096
    workbench project qwen2.5-vl-3b --device 8elite --runtime genie --image 512x512

MODEL_OR_CONFIG is a model directory, a config.json, 'demo', or a shape in assets/model_shapes.json; only
shapes are read (no weights), so a 7B projects in seconds. A `workbench quantize` directory uses its own plan.
Decode tokens/s is bounded by bandwidth / bytes read per token. With the device's LLM runtime (--runtime; by
default its class's own: Genie on a Snapdragon, RKLLM on a Rockchip board) speed, first-token time and memory are
fitted to the vendor's own measurements of that device and runtime, printed with the error the fit had on models
it had not seen and the nearest measurement; --runtime none gives the bound times the practitioners' efficiency.
A vision-language model (a VL folder or config, or a name in the shapes' "vision_shapes") adds one image's tokens to
the prompt and its vision encoder's time to the first token (--image WxH; default the size Qualcomm's export fixes).
"""
from __future__ import annotations

from ..errors import PlanError
from ..model.load import is_quantized_dir, resolve_model_path
from ..devices.runtimes import RUNTIMES, runtime_for_device
from ..quantize.plan import QuantPlan
from ..units import format_bytes
from .common import count, number, add_json_flag, add_model_argument, print_json
from ..devices.profiles import get_device
from ..devices.projection import AUTO, check_claim, project
from ..devices.vision_projection import parse_image_size, project_vision, vision_model

HELP = "project memory, decode tokens/s and prefill time of a model and plan on a device"
BITS = {16: "fp16", 8: "int8", 4: "int4"}


def add_arguments(p):
    add_model_argument(p, "a model directory, a config.json, 'demo', or a shape name from assets/model_shapes.json "
                          "(qwen2.5-1.5b, qwen3-1.7b, ...)")
    p.add_argument("--device", required=True, help="device profile: file name, name or alias (`workbench devices`)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--plan", help="quantization plan JSON")
    group.add_argument("--bits", type=int, choices=sorted(BITS), help="uniform plan: 16 (fp16), 8 or 4")
    p.add_argument("--embeddings", help="with --bits: precision of the embedding and lm_head (default: the runtime's "
                   "own layout, or fp16 without one)")
    p.add_argument("--runtime", choices=[*RUNTIMES, "none"], help="the device's LLM runtime (default: the device "
                   "class's own; 'none': no runtime, the generic bandwidth projection)")
    p.add_argument("--context", type=count(1), default=1024, help="tokens in the KV cache while decoding (default 1024)")
    p.add_argument("--ram-gb", type=number(0, low_open=True), help="RAM of your phone or board in GB, where the device profile (a "
                   "SoC's) does not know it or differs")
    p.add_argument("--prompt", type=count(1), default=128, help="prompt tokens for the prefill bound (default 128)")
    p.add_argument("--image", help="a vision-language model's image size WIDTHxHEIGHT (default: the size Qualcomm's "
                   "export fixes: 504x336 for Qwen2.5-VL, 512x512 for Qwen3-VL)")
    p.add_argument("--encoder-precision", choices=("int8", "fp16"), default="int8", help="the vision encoder's "
                   "weights (default int8: the w8a16 preset)")
    p.add_argument("--claim-decode", type=number(0, low_open=True), help="a published decode tokens/s to hold against the bound")
    p.add_argument("--claim-peak-gb", type=number(0, low_open=True), help="a published peak memory (GB) to hold against the weights")
    p.add_argument("--claim-ttft-ms", type=number(0, low_open=True), help="a published time to first token (ms)")
    add_json_flag(p)


def plan_for(args, runtime=None) -> QuantPlan | None:
    """--plan, --bits (with a runtime and no --embeddings: the runtime's own layout at those bits), a quantized
    directory's own plan, or None: the runtime's recipe, else fp16."""
    if args.plan:
        return QuantPlan.load(args.plan)
    if args.bits:
        if runtime is not None and args.embeddings is None:
            own = [lb for lb in runtime.precisions if runtime.plan(lb).default == BITS[args.bits]]
            if own:
                return runtime.plan(own[0])
        return QuantPlan.uniform(BITS[args.bits], keep_embeddings=args.embeddings or "fp16")
    if is_quantized_dir(args.model):
        return QuantPlan.load(resolve_model_path(args.model) / "plan.json")
    return None


def run(args) -> int:
    if args.context < 0 or args.prompt < 1:
        raise PlanError(f"--context must be >= 0 and --prompt >= 1 (got {args.context}, {args.prompt})")
    dev = get_device(args.device)
    runtime = None if args.runtime == "none" else (args.runtime or AUTO)
    rt = runtime_for_device(dev, None if runtime == AUTO else runtime) if runtime else None
    if args.image or vision_model(args.model) is not None:
        return _run_vision(args, dev, runtime, rt)
    p = project(args.model, dev, plan_for(args, rt), context=args.context, prompt=args.prompt,
                ram_gb=args.ram_gb, runtime=runtime)
    claims = check_claim(p, decode_tps=args.claim_decode, peak_gb=args.claim_peak_gb, ttft_ms=args.claim_ttft_ms)
    if args.json:
        print_json({**p.to_dict(), "claims": [c.__dict__ for c in claims]})
        return 0
    for line in format_projection(p):
        print(line)
    for c in claims:
        verdict = {True: "possible", False: "IMPOSSIBLE", None: "cannot be decided"}[c.possible]
        print(f"claim {c.what} {c.claimed:g}: {verdict}: {c.arithmetic}")
    return 0


def _tps(x: float) -> str:
    """Tokens/s to one decimal, or two significant digits below 0.1 (a huge context's bound is not 0.0)."""
    return f"{x:.1f}" if x >= 0.1 else f"{x:.2g}"


def _run_vision(args, dev, runtime, rt) -> int:
    vp = project_vision(args.model, dev, plan_for(args, rt), image=parse_image_size(args.image) if args.image else None,
                        context=args.context, prompt=args.prompt, runtime=runtime, ram_gb=args.ram_gb,
                        encoder_precision=args.encoder_precision)
    if args.json:
        print_json(vp.to_dict())
        return 0
    for line in format_projection(vp.text) + format_vision(vp):
        print(line)
    return 0


def _ms(x) -> str:
    return "unknown" if x is None else f"{x:,.1f} ms"


def format_vision(vp) -> list[str]:
    """The image's lines under the language part's table: tokens, encoder, first token and its share."""
    c = vp.vendor_check
    lines = [f"  image              {vp.image[0]}x{vp.image[1]} -> {vp.resized[0]}x{vp.resized[1]}: {vp.patches:,} "
             f"patches, {vp.image_tokens:,} image tokens (in the prompt above)",
             f"  vision encoder     {vp.encoder_parameters / 1e6:,.0f} M parameters at {vp.encoder_precision}, "
             f"{vp.encoder_flops / 1e9:,.0f} GFLOP per image: {_ms(vp.encoder_ms)}",
             f"  encoder basis      {vp.basis}",
             f"  image tokens       {_ms(vp.image_prefill_ms)} of the language part's prefill",
             f"  first token        {_ms(vp.first_token_ms)} with the image = encoder {_ms(vp.encoder_ms)} + "
             f"language part {_ms(vp.text_first_token_ms)}",
             "  encoder's share    " + ("unknown" if vp.encoder_share is None else
                                        f"{vp.encoder_share:.0%} of the first token")]
    if c is None or not c.n:
        lines.append("  vendor VLM check   no vendor VLM measurement of this device and runtime")
    else:
        errs = ", ".join(x for x in (f"first token within {c.ttft_error:.0%}" if c.ttft_error is not None else "",
                                     f"decode within {c.decode_error:.0%}" if c.decode_error is not None else "") if x)
        lines.append(f"  vendor VLM check   {errs} (median) on {c.n} vendor VLM measurement(s) held out of the fit "
                     f"({', '.join(c.models)}, language part, text prompt; {c.source})")
    lines.append("  note: no vendor publishes a vision encoder's latency: the encoder's time is projected, not fitted to "
                 "a measured encoder")
    return lines + [f"  note: {n}" for n in vp.notes]


def _yes(x):
    return "unknown" if x is None else ("yes" if x else "NO")


def _unsupported(layers: list) -> str:
    if not layers:
        return "nothing (every layer's precision is supported)"
    more = f" and {len(layers) - 4} more" if len(layers) > 4 else ""
    return ", ".join(f"{n} ({q})" for n, q in layers[:4]) + more


def format_projection(p) -> list[str]:
    """The table `workbench project` prints (also used by bench/projection.py); GB = 1e9 bytes."""
    gb = 1e9
    if p.vendor is not None and p.vendor.decode_tps is not None:
        eff = (f"{p.efficiency:.2f} of the bound, as the vendor fit below projects" if p.efficiency is not None
               else "the vendor fit below (no bound to compare)")
    else:
        eff = (f"{p.efficiency:.2f} (fit error up to {p.efficiency_error:.0%}; {p.efficiency_basis})"
               if p.efficiency is not None else p.efficiency_basis)
    decode = (f"{_tps(p.projected_decode_tps)} tok/s projected, bound {_tps(p.decode_bound_tps)} tok/s "
              f"({p.bandwidth_gbps:g} GB/s / {(p.bytes_per_token + p.kv_bytes) / gb:.3f} GB per token)"
              if p.projected_decode_tps is not None else
              (f"bound {_tps(p.decode_bound_tps)} tok/s" if p.decode_bound_tps is not None else "unknown"))
    prefill = (f"{p.prefill_bound_ms:.0f} ms bound for {p.prompt} tokens (compute "
               + (f"{p.prefill_compute_ms:.0f} ms at {p.compute_tops:g} {p.compute_precision} TOPS"
                  if p.prefill_compute_ms is not None else "unknown")
               + (f", weights read {p.prefill_memory_ms:.0f} ms)" if p.prefill_memory_ms is not None else ")")
               if p.prefill_bound_ms is not None else "unknown")
    lines = [
        f"{p.model} on {p.device} ({p.parameters / 1e6:,.1f} M parameters, {p.bits_per_weight:.2f} bits/weight)",
        f"  weights            {format_bytes(p.weight_bytes)} resident, "
        f"{format_bytes(p.bytes_per_token)} read per token",
        f"  KV cache           {format_bytes(p.kv_bytes)} at {p.context} tokens ({p.kv_bytes_per_token:,} B/token)",
        f"  graph buffers      {format_bytes(p.buffer_bytes)}",
        f"  fits RAM           {_yes(p.fits_ram)} ({format_bytes(p.total_bytes)}"
        + (f" of {format_bytes(p.ram_bytes)})" if p.ram_bytes else ")"),
        f"  fits NPU limit     {_yes(p.fits_npu)}"
        + (f" ({format_bytes(p.npu_limit_bytes)})" if p.npu_limit_bytes else ""),
        f"  decode             {decode}",
        f"  efficiency         {eff}",
        f"  prefill            {prefill}",
        f"  NPU cannot run     {_unsupported(p.unsupported_layers)}",
    ]
    return lines + vendor_lines(p) + [f"  note: {n}" for n in p.notes]


def _pct(err, n) -> str:
    return f"within {err:.0%} (median) on {n} held-out measurement(s)" if err is not None else "no held-out error"


def vendor_lines(p) -> list[str]:
    """The runtime, the fitted figures with their held-out errors, and the nearest vendor measurement."""
    v = p.vendor
    if v is None:
        return [f"  runtime            {p.runtime or 'none'} (generic bandwidth projection)"]
    lines = [f"  runtime            {v.runtime_title} ({v.runtime}), projected at its {v.precision} fit",
             f"  fit                {v.basis}"]
    if v.decode_tps is not None:
        lines.append(f"  decode (fitted)    {v.decode_tps:.1f} tok/s, {_pct(v.decode_error, v.decode_n)}")
    if v.ttft_ms is not None:
        lines.append(f"  first token        {v.ttft_ms:.0f} ms for {p.prompt} prompt tokens, {_pct(v.ttft_error, v.ttft_n)}")
    if v.peak_bytes is not None:
        lines.append(f"  peak memory        {v.peak_bytes / 1e6:,.0f} MB, {_pct(v.memory_error, v.memory_n)}")
    n = v.nearest
    if n:
        extra = "".join([f", first token {n['ttft_ms']:.0f} ms" if n.get("ttft_ms") else "",
                         f", {n['peak_mb']:,.0f} MB" if n.get("peak_mb") else ""])
        lines.append(f"  nearest measured   {n['model']} {n['precision']} on {n['vendor_device']}, {n['runtime']}, "
                     f"context {n['context']}: {n['decode_tps']:.1f} tok/s{extra} ({n['source']})")
    return lines + [f"  note: {x}" for x in v.notes]
