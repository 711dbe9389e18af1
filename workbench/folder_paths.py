"""A path that a folder's own file names must stay inside that folder: a model folder is data, not a pointer
to the rest of the machine (an external-data ``location`` of ``../../etc/passwd`` is refused before it is
opened)."""
from __future__ import annotations

from pathlib import Path

from workbench.errors import ModelLoadError

__all__ = ["inside_folder", "json_items", "refuse_native_libraries"]


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
