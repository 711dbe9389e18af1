"""A path that a folder's own file names must stay inside that folder: a model folder is data, not a pointer
to the rest of the machine (an external-data ``location`` of ``../../etc/passwd`` is refused before it is
opened)."""
from __future__ import annotations

from pathlib import Path

from workbench.errors import ModelLoadError

__all__ = ["inside_folder", "json_items", "refuse_native_libraries", "check_graph_paths"]


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
