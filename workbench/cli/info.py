"""Show a model's quantizable layers and its size at each precision (and a vision-language model's parts:
vision encoder, projector, language model, each with its parameters and bytes)."""
from __future__ import annotations

from ..model.load import load_model
from ..units import format_bytes
from .common import add_device_argument, add_json_flag, add_model_argument, print_json

HELP = "layer table and size per precision"
PRECISIONS = ("fp32", "fp16", "int8", "int4")


def add_arguments(p):
    add_model_argument(p)
    add_device_argument(p)
    add_json_flag(p)
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code to run")


def run(args) -> int:
    lm = load_model(args.model, device=args.device, load_tokenizer=False, trust_remote_code=args.trust_remote_code)
    cfg, text = lm.config, lm.text_config
    sizes = {p: lm.size_bytes(precision=p) for p in PRECISIONS}
    parts = lm.parts() if lm.is_vision else []
    if args.json:
        doc = {"model": str(lm.path), "model_type": cfg.model_type, "vocab_size": text.vocab_size,
               "parameters": lm.parameters, "hidden_size": text.hidden_size,
               "num_hidden_layers": text.num_hidden_layers, "size_bytes": sizes,
               "layers": [layer.to_dict() for layer in lm.layers]}
        if lm.is_vision:
            doc["vision"] = True
            doc["parts"] = [part.to_dict() for part in parts]
        print_json(doc)
        return 0
    print(f"{lm.path}  ({cfg.model_type}, {lm.parameters / 1e6:.2f} M parameters, vocab {text.vocab_size})")
    if parts:
        print(f"{'part':<16} {'modules':<44} {'params':>11} {'bytes':>10} {'layers':>7}")
        for part in parts:
            print(f"{part.name:<16} {', '.join(part.prefixes):<44} {part.parameters:>11,} "
                  f"{format_bytes(part.bytes):>10} {part.layers:>7}")
        print()
    w = max([40] + [len(layer.name) for layer in lm.layers])  # a VLM's names are longer than a text model's
    header = f"{'layer':<{w}} {'shape':>12} {'params':>11} " + " ".join(f"{p:>10}" for p in PRECISIONS)
    print(header)
    print("-" * len(header))
    for layer in lm.layers:
        shape = "x".join(map(str, layer.shape))
        tied = "  (tied)" if layer.tied_to else ""
        print(f"{layer.name:<{w}} {shape:>12} {layer.parameters:>11,} "
              + " ".join(f"{format_bytes(layer.bytes_at(p)):>10}" for p in PRECISIONS) + tied)
    print("-" * len(header))
    print(f"{'model total (tied weights once, norms at fp16)':<{w + 25}}"
          + " ".join(f"{format_bytes(sizes[p]):>10}" for p in PRECISIONS))
    return 0
