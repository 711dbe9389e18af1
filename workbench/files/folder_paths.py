"""A path that a folder's own file names must stay inside that folder: a model folder is data, not a pointer
to the rest of the machine (an external-data ``location`` of ``../../etc/passwd`` is refused before it is
opened)."""
from __future__ import annotations

from pathlib import Path

from workbench.errors import ModelLoadError

__all__ = ["inside_folder", "json_items", "refuse_native_libraries", "check_graph_paths", "folder_json", "folder_file",
           "named_paths"]


def inside_folder(folder: str | Path, named: str, named_by: str | Path, key: str = "path") -> Path:
    """``folder / named`` resolved (symlinks followed), or ModelLoadError if that lies outside ``folder``."""
    root = Path(folder).resolve()
    if not isinstance(named, str) or not named:
        raise ModelLoadError(f"'{named_by}' names an empty or non-text {key} ({named!r}): export or convert again")
    target = (root / named).resolve()
    if Path(named).is_absolute() or (target != root and root not in target.parents):
        raise ModelLoadError(f"'{named_by}' names {key} '{named}', which resolves outside its folder '{root}' "
                             f"(to '{target}'): a folder's files may only name files inside it; export or convert "
                             "again")
    return target


def json_items(doc, key_path: str = ""):
    """Every ``(key path, key, value)`` of a JSON document's objects, depth first (``model.decoder.filename``)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            here = f"{key_path}.{k}" if key_path else str(k)
            yield here, k, v
            yield from json_items(v, here)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_items(v, f"{key_path}[{i}]")


def refuse_native_libraries(doc, named_by: str | Path) -> None:
    """ModelLoadError if any ``custom_ops_library`` appears in ``doc``: a model folder never gets to load native
    code into the workbench's process."""
    for here, k, v in json_items(doc):
        if k == "custom_ops_library":
            raise ModelLoadError(f"'{named_by}' names a native library at {here} ({v!r}): the workbench does "
                                 "not load code named by a model folder; remove the key, or pass "
                                 "allow_custom_ops=True if you trust this folder")


def check_graph_paths(graph: str | Path) -> None:
    """ModelLoadError unless every file an ONNX graph names lies inside its folder: each initializer's external
    data ``location`` and each EPContext node's ``ep_cache_context`` (a compiled context binary kept beside the
    graph). Read before any session is made, so onnxruntime never opens what a hostile graph points at."""
    import onnx
    from onnx.external_data_helper import uses_external_data
    graph = Path(graph)
    proto = onnx.load(str(graph), load_external_data=False)
    for init in proto.graph.initializer:
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            inside_folder(graph.parent, info.get("location", ""), graph, "external data location")
    for node in proto.graph.node:
        if node.op_type != "EPContext":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if int(attrs.get("embed_mode", 1)) == 0:  # 1: the binary is inside the graph itself
            ref = attrs.get("ep_cache_context", b"")
            inside_folder(graph.parent, ref.decode("utf-8", "replace") if isinstance(ref, bytes) else ref, graph,
                          f"ep_cache_context of node '{node.name}'")


# -- a native runtime's folder, checked before the runtime gets it ---------------------------------------
# A native engine (MNN's LLM engine, ExecuTorch, onnxruntime-genai) trusts its folder: a config naming
# /etc/passwd is opened, a truncated weight file is read past its end (a segfault that takes the workbench
# with it). These checks run first, in Python, so a damaged or tampered folder is one line naming the file.

def folder_json(path: str | Path, what: str = "") -> dict:
    """The JSON object in ``path``, or ModelLoadError naming the file (missing, not UTF-8, not JSON, not an
    object): a runtime handed a config it cannot parse runs on its defaults instead of saying so."""
    path = Path(path)
    hint = f"convert it again{f' ({what})' if what else ''}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(f"'{path}' is missing: {hint}") from None
    except UnicodeDecodeError:
        raise ModelLoadError(f"'{path}' is not UTF-8 text: {hint}") from None
    except OSError as e:
        raise ModelLoadError(f"'{path}' cannot be read ({e.strerror or e}): {hint}") from None
    import json
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ModelLoadError(f"'{path}' is not JSON ({e}): {hint}") from None
    if not isinstance(doc, dict):
        raise ModelLoadError(f"'{path}' holds a JSON {type(doc).__name__}, not an object: {hint}")
    return doc


def folder_file(folder: str | Path, named, named_by: str | Path, key: str = "file", *, size: int | None = None,
                at_least: int = 1, why: str = "") -> Path:
    """The regular file ``folder / named``: inside the folder (no absolute path, no ``..``, no symlink leaving
    it), present, and ``size`` bytes exactly (or at least ``at_least``); ModelLoadError naming it otherwise.
    ``why`` says where an expected size comes from (``vocab x hidden x 2``)."""
    path = inside_folder(folder, named, named_by, key)
    shown = Path(folder) / named
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "is missing"
        raise ModelLoadError(f"'{shown}' ({key} in '{named_by}') {what}: convert it again")
    have = path.stat().st_size
    if size is not None and have != size:
        raise ModelLoadError(f"'{shown}' holds {have:,} bytes, not the {size:,} {why or 'expected'}: it is truncated "
                             "or not this model's; convert it again")
    if size is None and have < at_least:
        raise ModelLoadError(f"'{shown}' holds {have:,} bytes, less than the {at_least:,} "
                             f"{why or 'a model file needs'}: it is truncated; convert it again")
    return path


def named_paths(folder: str | Path, doc, named_by: str | Path, is_path_key) -> dict[str, Path]:
    """``{key path: resolved file}`` for every string ``doc`` gives under a key ``is_path_key(key)`` accepts, each
    checked to lie inside ``folder`` (``inside_folder``); empty strings are left to the caller."""
    out = {}
    for here, k, v in json_items(doc):
        if isinstance(k, str) and is_path_key(k) and isinstance(v, str) and v:
            out[here] = inside_folder(folder, v, named_by, here)
    return out
