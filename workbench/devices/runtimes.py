"""The LLM runtimes a device runs a model with, and the bytes each reads per decoded token.

    rt = get_runtime("genie"); rt.plan()            # Qualcomm's w4a16 recipe as a plan
    rt.precision_label(QuantPlan.uniform("int8"))   # which of the vendor's measured precisions a plan is

The same phone runs Qwen3-0.6B at 125 tok/s with Genie and at 31-87 with llama.cpp: a runtime decides the
weight layout a precision turns into (per-channel or grouped scales, what the lm_head and the embedding are
kept at), the KV cache's element size and how much of it a decode step reads. Each runtime here names the
vendor measurements it is fitted to (``workbench.devices.vendor_fit``): ``measured`` is the runtime's name in
``assets/vendor_measurements.json``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import WorkbenchError
from ..quantize.plan import QuantPlan

__all__ = ["DeviceRuntime", "RUNTIMES", "get_runtime", "runtime_for_device", "recipe_plan"]


def recipe_plan(linear: str, group_size: int | None, *, lm_head: str = "int8", embedding: str = "fp16",
                symmetric: bool = False) -> QuantPlan:
    """A runtime's own layout as a plan: its linear layers, lm_head and embedding table."""
    return (QuantPlan(default=linear, group_size=group_size, symmetric=symmetric)
            .with_override("*embed_tokens", embedding).with_override("lm_head", lm_head))


# the vendors' precision labels -> the layout their runtime stores (the sources' own descriptions)
RECIPES = {
    # Qualcomm's LLM recipe (qai-hub-models): int4 per-channel weights, int8 lm_head, int16 embedding (an int16
    # table takes the bytes of an fp16 one); "w4" is the same weights without its activation encodings
    "w4a16": recipe_plan("int4", None), "w4": recipe_plan("int4", None),
    # llama.cpp's Q4_0 file: 32-weight blocks with a float16 scale; the output matrix at Q6_K, as llama-quantize
    # keeps it
    "q4_0": recipe_plan("int4", 32, lm_head="int6-k", embedding="int4", symmetric=True),
    # RKLLM (Rockchip's benchmark.md dtypes): per-channel int8 or int4, or int4 in 128-weight groups
    "w8a8": recipe_plan("int8", None), "w4a16_g128": recipe_plan("int4", 128),
    # MLC LLM's q4f16_ft (mlc-llm quantization/ft_quantization.py): symmetric int4 per output channel with fp16
    # scales for the linear layers; the lm_head and the embedding fall back to int4 in 32-weight groups, counted
    # here per channel like the body (0.5 bits a weight under, about 1% of an 8B's bytes)
    "q4f16_ft": recipe_plan("int4", None, lm_head="int4", embedding="int4", symmetric=True),
}


@dataclass(frozen=True)
class DeviceRuntime:
    """One LLM runtime: its layouts, its KV cache, the device classes it runs on."""

    name: str
    title: str
    device_classes: tuple[str, ...]
    precisions: tuple[str, ...]  # the vendor precision labels it is measured at; the first is its recipe
    kv_bytes: int  # bytes per cached key or value element
    # "allocated": the decode graph has static shapes and reads the cache at its whole context (HTP graphs);
    # "filled": only the tokens so far (llama.cpp, RKLLM); ``kv_tokens`` turns it into the tokens a step reads
    kv_read: str
    measured: str | None  # its runtime name in assets/vendor_measurements.json; None: nobody published one
    source: str
    not_on: tuple[str, ...] = ()  # device profiles of its classes it does not run on, and why
    not_on_why: str = ""
    # decode fitted with a byte rate per model family where its measurements hold two or more families of two or
    # more models each: on every chip AI Hub measured but the X Elite, Genie runs its Qwen3 builds 1.14-2.93x as fast
    # as QAIRT on the same binaries and its Llama builds 0.84-1.41x (`python bench/projection.py --residuals`)
    rate_per_family: bool = False

    def runs_on(self, device) -> bool:
        return device.device_class in self.device_classes and device.key not in self.not_on

    def kv_tokens(self, context: int, prompt: int, new_tokens: int | None = None) -> float:
        """Cached tokens a decode step reads, on average over a generation of ``new_tokens`` after ``prompt``.

        An allocated cache is read at its whole ``context`` whatever it holds. A filled one holds the prompt and
        the tokens generated so far: prompt + new_tokens / 2 on average (Rockchip's 128 + 64 rows read 160, not
        192); without ``new_tokens`` (AI Hub's rows, a user's ``--context``) the context is what it holds."""
        if self.kv_read == "allocated" or new_tokens is None:
            return float(context)
        return float(min(context, prompt + new_tokens / 2))

    def plan(self, precision: str | None = None) -> QuantPlan:
        """The runtime's layout for one of its precisions (default: its recipe) as a plan."""
        label = precision or self.precisions[0]
        if label not in self.precisions:
            raise WorkbenchError(f"runtime '{self.name}' is measured at {', '.join(self.precisions)}, not '{label}'")
        return RECIPES[label]

    def precision_label(self, plan: QuantPlan) -> tuple[str, str | None]:
        """(the measured precision a plan corresponds to, a note when it is only the nearest one).

        A plan is matched by its linear layers' precision and group size; one no measurement covers is
        projected with the nearest (same bits first), and the note says so."""
        default = plan.default or "fp16"
        for label in self.precisions:
            r = RECIPES[label]
            if r.default == default and r.group_size == plan.group_size:
                return label, None
        same_bits = [lb for lb in self.precisions if RECIPES[lb].default == default]
        label = (same_bits or list(self.precisions))[0]
        return label, (f"no {self.title} measurement at {default}"
                       f"{'' if plan.group_size is None else f' in groups of {plan.group_size}'}: projected with "
                       f"its {label} fit, with the plan's own bytes")


RUNTIMES: dict[str, DeviceRuntime] = {r.name: r for r in (
    DeviceRuntime("genie", "Qualcomm Genie (QNN HTP)", ("hexagon-htp",), ("w4a16", "w4"), 1, "allocated", "genie",
                  "qai-hub-models 0.65.0: int8 KV cache, 128-token prefill and 1-token decode graphs",
                  rate_per_family=True),
    DeviceRuntime("qairt", "Qualcomm QAIRT through GenieX", ("hexagon-htp",), ("w4a16", "w4"), 1, "allocated",
                  "qairt", "qai-hub-models 0.65.0 (runtime geniex_qairt): the same context binaries as Genie"),
    *(DeviceRuntime(f"llama.cpp-{unit}", f"llama.cpp on the {unit.upper()} (GenieX)", ("hexagon-htp",), ("q4_0",),
                    2, "filled", f"llama.cpp-{unit}",
                    f"qai-hub-models 0.65.0 (runtime geniex_llamacpp, compute unit {unit}): a Q4_0 GGUF, fp16 KV")
      for unit in ("npu", "gpu", "cpu")),
    DeviceRuntime("rkllm", "Rockchip RKLLM", ("rknpu",), ("w8a8", "w4a16", "w4a16_g128"), 2, "filled", "rkllm",
                  "airockchip/rknn-llm benchmark.md: 128 prompt and 64 new tokens; RK3588 runs only w8a8"),
    DeviceRuntime("mlc", "MLC LLM (CUDA)", ("jetson-gpu",), ("q4f16_ft",), 2, "filled", "mlc",
                  "NVIDIA Jetson AI Lab benchmarks.md: jetson-containers' MLC benchmark, q4f16_ft, 16 prompt and 128 "
                  "new tokens; a paged fp16 KV cache read as far as it is filled",
                  ("jetson-nano",), "jetson-containers builds MLC for L4T 35 and later (JetPack 5, packages/llm/mlc/"
                  "config.py); the Jetson Nano's last is L4T 32 (JetPack 4)"),
    DeviceRuntime("mnn", "Alibaba MNN LLM engine", ("hexagon-htp", "davinci-npu", "rknpu"), ("w4a16_g128",), 2,
                  "filled", None, "MNN's llmexport default: int4 weights in 128-weight blocks; no vendor "
                  "measurement is published in a form reachable here"),
)}
# a device class's own vendor runtime: what `workbench project` assumes when no --runtime is given
DEFAULT_RUNTIME = {"hexagon-htp": "genie", "rknpu": "rkllm", "jetson-gpu": "mlc"}


def get_runtime(name: str) -> DeviceRuntime:
    if name not in RUNTIMES:
        raise WorkbenchError(f"unknown runtime '{name}'; choose one of: {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def runtime_for_device(device, name: str | None) -> DeviceRuntime | None:
    """The runtime asked for (refused if it does not run on the device), or the device class's own; None: no LLM
    runtime of this class is measured, or the class's own does not run on this device (the generic bandwidth
    projection applies)."""
    cls = device.device_class
    if name is None:
        rt = RUNTIMES.get(DEFAULT_RUNTIME.get(cls, ""))
        return rt if rt is not None and rt.runs_on(device) else None
    rt = get_runtime(name)
    if not rt.runs_on(device):
        runs = [r.name for r in RUNTIMES.values() if r.runs_on(device)]
        why = rt.not_on_why if device.key in rt.not_on else f"it runs on {', '.join(rt.device_classes)} devices"
        raise WorkbenchError(f"runtime '{name}' does not run on {device.name} ({why}); for it choose one of: "
                             + (", ".join(runs) or "none (project without --runtime)"))
    return rt
