"""Running what a target wrote: one seam from a folder (or one of its files) to the runner of the target that wrote it.

    runner = open_runner("out/int4", threads=1)         # conversion.json names the target that wrote the folder
    runner = open_runner("out/onnx")                     # an export: recognised by the files a target declares
    found = locate("out/int4"); found.target.name, found.entry, found.decode_graph
    for found in find_runnable("out/profile"): ...       # every runnable folder below a root, for profiling

Every runnable target registers a runner, ``runner(folder, *, threads)``, and the ``files`` its output
holds (``workbench.targets.registry.Target``). ``workbench generate`` and ``workbench profile``, the
Generate and Profile panels open artifacts only through this module, so a runnable target is one
module under ``targets/`` (plus its rule table) and none of them changes. A runner is what
``runtime.stream.stream_tokens`` drives: ``run_prefill`` / ``run_decode`` with a compact KV cache, or
``steps()``; it names its ``runtime`` (``"onnxruntime"``, ``"MNN"``, ...).

Which target a folder belongs to: the one its ``conversion.json`` names, when that target has a runner
(its files must all be there); otherwise the first registered runnable target whose files are all
there (a ``workbench export`` output is ``prefill.onnx`` + ``decode.onnx``, which ort-int4's runner runs).
A folder with only part of a target's files is a one-line error naming what is missing.

The runners themselves are below the targets, in ``workbench.runtime``: ``onnx_runner`` (``OnnxCausalLM``),
``stream`` (the token loop, sampling), ``parity`` (PyTorch against another runtime).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import ModelLoadError, WorkbenchError, printable
from ..targets import registry
from ..targets.registry import get_target

__all__ = ["Runnable", "locate", "find_runnable", "not_runnable_here", "open_runner", "runnable_targets", "describe_files",
           "conversion_record", "conversion_target", "target_files", "CONVERSION_FILE"]

CONVERSION_FILE = "conversion.json"
DATA_SUFFIXES = (".json", ".txt")  # declared files that are settings, not model files (not counted as its size)


@dataclass(frozen=True)
class Runnable:
    """A folder some target's runner opens: the folder, that target, and the target its conversion.json names."""

    folder: Path
    target: object  # workbench.targets.Target
    recorded: str | None = None  # conversion.json's target (None: none, or one without a runner)

    @cached_property
    def files(self) -> tuple[str, ...]:
        """What the folder holds for its target: the target's ``files``, or those its ``layout`` finds there (read
        once: entry, model_files and the decode graphs all ask)."""
        return target_files(self.folder, self.target)

    @property
    def entry(self) -> Path:
        """The file the runner opens first (the prefill graph, ``model.onnx``), or the folder for a target
        that declares no files."""
        return self.folder / self.files[0] if self.files else self.folder

    @property
    def model_files(self) -> list[Path]:
        """The declared files that hold the model (settings such as ``genai_config.json`` left out)."""
        return [self.folder / f for f in self.files if not f.endswith(DATA_SUFFIXES)]

    @property
    def decode_graphs(self) -> list[Path]:
        """The graphs one decode step runs, in order: the ``decode*`` files (a graph split into parts has several),
        else the one model file serving both prefill and decode."""
        files = self.model_files
        decode = [f for f in files if f.name.startswith("decode")]
        return decode or (files if len(files) == 1 else [])

    @property
    def decode_graph(self) -> Path | None:
        """The first (usually the only) graph of a decode step."""
        graphs = self.decode_graphs
        return graphs[0] if graphs else None

    def open(self, *, threads: int | None = None):
        """The target's runner over the folder."""
        return self.target.runner(self.folder, threads=threads)


def runnable_targets() -> list:
    """Registered targets with a runner, in registration order."""
    return [t for t in registry.registered_targets() if t.runner is not None]


def describe_files() -> str:
    """What a runnable folder holds, target by target: ``prefill.onnx + decode.onnx, model.onnx + genai_config.json``."""
    seen = []
    for t in runnable_targets():
        text = " + ".join(t.files)
        if t.files and text not in seen:
            seen.append(text)
    return ", ".join(seen[:-1]) + (" or " if len(seen) > 1 else "") + seen[-1] if seen else "(no runnable target)"


def conversion_record(folder: str | Path) -> dict | None:
    """``folder``'s ``conversion.json``, or None (no such file, or not a JSON object)."""
    try:
        doc = json.loads((Path(folder) / CONVERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def conversion_target(folder: str | Path) -> str | None:
    """The target ``folder``'s ``conversion.json`` names, or None (no such file, or not one the workbench wrote)."""
    target = (conversion_record(folder) or {}).get("target")
    return printable(target) if isinstance(target, str) else None  # shown in messages: no terminal escapes


# targets without a runner whose prefill.onnx / decode.onnx take inputs no runner here feeds (rknn's graphs take
# rope_cos / rope_sin, computed by the device's host code); a qnn folder's float graphs do run as ort-int4's
OWN_FEEDS = frozenset({"rknn"})


def not_runnable_here(folder: str | Path) -> str | None:
    """The target ``folder``'s conversion.json names when its graphs only look like another target's files: one
    that feeds its own inputs (``OWN_FEEDS``), or one registered as not running here (TensorRT's model.onnx looks like
    ort-int4's, but Export says it does not run here: Generate and Profile must not run it either)."""
    recorded = conversion_target(folder) if Path(folder).is_dir() else None
    if recorded in OWN_FEEDS:
        return recorded
    try:
        target = get_target(recorded) if recorded else None
    except WorkbenchError:
        return None  # a target this install does not register: its files decide
    return recorded if target is not None and not target.runnable else None


def target_files(folder: Path, target) -> tuple[str, ...]:
    """The files ``target``'s output holds in ``folder``: what its ``layout`` finds there, else its ``files``."""
    found = target.layout(folder) if getattr(target, "layout", None) is not None and folder.is_dir() else None
    return tuple(found) if found else target.files


def _missing(folder: Path, target) -> list[str]:
    return [f for f in target_files(folder, target) if not (folder / f).is_file()]


def locate(path: str | Path, *, strict: bool = True) -> Runnable | None:
    """The target whose runner opens ``path`` (a folder, or the first file a target declares), or None when
    nothing there runs. ``strict``: a folder or file with only part of a target's files is an error that
    names what is missing (not strict: None)."""
    p = Path(path)
    targets = runnable_targets()
    foreign = not_runnable_here(p.parent if p.is_file() else p)
    if foreign is not None and (p.is_dir() or any(t.files and t.files[0] == p.name for t in targets)):
        if not strict:  # another target's files (rknn's ONNX graphs) are not an ort-int4 folder
            return None
        raise ModelLoadError(f"'{p}' is a {foreign} conversion, which does not run here: pick an output of "
                             f"{', '.join(t.name for t in targets)}")
    if p.is_file():
        folder, recorded = p.parent, conversion_target(p.parent)
        named = [t for t in targets if t.files and t.files[0] == p.name]
        if not named:
            if not strict:
                return None
            firsts = ", ".join(dict.fromkeys(t.files[0] for t in targets if t.files))
            raise ModelLoadError(f"'{p}' is not a prefill graph or model file a target runs ({firsts}): pass the "
                                 "folder `workbench convert` or `workbench export` wrote")
        target = next((t for t in named if t.name == recorded), named[0])
        missing = _missing(folder, target)
        if missing:
            if not strict:
                return None
            raise ModelLoadError(f"'{p}' has no {', '.join(missing)} beside it: pass a whole {target.name} folder "
                                 f"(`workbench convert --target {target.name}`)")
        return Runnable(folder, target, recorded if recorded == target.name else None)
    if not p.is_dir():
        return None
    recorded = conversion_target(p)
    own = next((t for t in targets if t.name == recorded), None)
    if own is not None:
        missing = _missing(p, own)
        if not missing:
            return Runnable(p, own, recorded)
        if strict:
            raise ModelLoadError(f"'{p}' is a {own.name} conversion without {', '.join(missing)}: its runner needs "
                                 f"{' and '.join(target_files(p, own))}; convert again")
        return None
    for t in targets:
        if t.files and not _missing(p, t):
            return Runnable(p, t, None)
    if strict:
        for t in targets:
            if t.files and (p / t.files[0]).is_file():
                raise ModelLoadError(f"'{p}' has {t.files[0]} but no {', '.join(_missing(p, t))}: its runner needs "
                                     f"{' and '.join(t.files)}; convert or export again")
    return None


def find_runnable(root: str | Path) -> list[Runnable]:
    """Every runnable folder at or below ``root`` (folders still being written, ``*.partial``, skipped), by path."""
    root = Path(root)
    if not root.is_dir():
        raise WorkbenchError(f"'{root}' is not a directory; pass the output of `workbench export` or "
                             "`workbench convert`")
    folders = [root] + sorted(d for d in root.rglob("*") if d.is_dir())
    found = [f for f in (locate(d, strict=False) for d in folders
                         if ".partial" not in str(d.relative_to(root))) if f is not None]
    if not found:
        raise WorkbenchError(f"nothing to run below '{root}' (no folder with {describe_files()}); export or convert "
                             "a model there first")
    return found


def open_runner(path: str | Path, *, threads: int | None = None):
    """The runner of the target that wrote ``path`` (a folder or its first file): ``get_target(name).runner``.

    The target is the one ``conversion.json`` names, or the one whose declared files the folder holds."""
    found = locate(path)
    if found is None:
        recorded = conversion_target(path) if Path(path).is_dir() else None
        names = ", ".join(t.name for t in runnable_targets())
        what = f"is a {recorded} conversion, which does not run here" if recorded else \
            f"holds nothing a target runs ({describe_files()})"
        raise ModelLoadError(f"'{path}' {what}: pick an output of {names}")
    return found.open(threads=threads)
