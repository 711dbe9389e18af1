"""The artifact store: every heavy step's result lives in ``<root>/<step>/<key>/``.

``key`` is a hash of the step's inputs, so the same inputs find the same artifact. An artifact
is complete exactly when its ``manifest.json`` exists: the payload is written into a
``.partial-<key>`` directory that is renamed into place only after the manifest is written, so
a killed step never leaves something that looks whole. A step that is interrupted can resume
from the files it left in its partial directory (``get_or_compute`` hands the same directory
back on the next call).

    ws = Workspace()                              # ./workspace, or $WORKBENCH_WORKSPACE
    art = ws.get_or_compute("calibrate", {"model": "demo", "samples": 128}, compute)
    art.path / "stats.safetensors"
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from ..errors import WorkbenchError, WorkspaceError, storage_failure, storage_message

__all__ = ["Workspace", "Artifact", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "read_json_file",
           "hash_inputs", "model_fingerprint", "file_sha256", "library_versions", "DEFAULT_WORKSPACE", "check_output_dir",
           "staged_output", "swap_into_place", "write_output_manifest", "rebase_paths", "resolve_output", "exclusive_lock",
           "output_lock", "make_parents", "remove_empty", "apply_umask", "storage_error"]

DEFAULT_WORKSPACE = Path(os.environ.get("WORKBENCH_WORKSPACE", "workspace"))
MANIFEST = "manifest.json"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write via a temporary file in the same directory and ``os.replace``: all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; the file is an ordinary output
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json_file(path: str | Path, what: str, *, error: type[Exception] = WorkspaceError, hint: str = ""):
    """Parse a JSON file, raising ``error`` that names ``what`` and the path when it is missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} '{p}' does not exist{hint}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{what} '{p}' is not valid JSON: {e}") from None


# -- output directories (--out) ------------------------------------------------------------------
# A step writes its --out only when the directory is new, empty, or a complete earlier output of
# the same kind: its manifest.json names the kind ("format") and lists every file with its size,
# so a directory holding anything else (a user's own file, a different output, a half-written
# one) is refused instead of deleted. The new output is written into a hidden sibling directory
# and swapped in only after the whole step has succeeded.

def _output_problem(p: Path, kind: str) -> str | None:
    """Why ``p`` (an existing non-empty directory) is not a complete earlier ``kind`` output, or None."""
    mf = p / MANIFEST
    if not mf.is_file():
        return "is not empty and has no workbench manifest.json"
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return "has a manifest.json that is not valid JSON"
    if not isinstance(manifest, dict) or manifest.get("format") != kind or not isinstance(manifest.get("files"), dict):
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return f"holds {'a ' + str(found) if isinstance(found, str) else 'another program'}'s output, not a {kind} one"
    listed = manifest["files"]
    present = {f.relative_to(p).as_posix(): f for f in p.rglob("*") if not f.is_dir() and f.name != MANIFEST}
    extra = sorted(set(present) - set(listed))
    if extra:
        return f"holds files the workbench did not write there ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''})"
    for name, meta in listed.items():
        f = present.get(name)
        if f is None or not isinstance(meta, dict) or f.stat().st_size != meta.get("size"):
            return f"is incomplete or was changed after it was written ('{name}')"
    return None


def resolve_output(path: str | Path) -> Path:
    """``path``, or the directory a symbolic link there points to: the replace rules apply to the link's target."""
    p = Path(path)
    return p.resolve() if p.is_symlink() else p


# -- one writer per output: an exclusive flock, which dies with its process (never left stale) ----
_HELD: dict[str, list] = {}  # lock file -> [fd, depth]: re-entrant within one process


def _lock_dir() -> Path:
    d = Path(tempfile.gettempdir()) / "workbench-locks"
    if not d.is_dir():
        d.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(d, 0o1777)  # shared by every user, as /tmp is
    return d


@contextmanager
def exclusive_lock(name: str, busy: str):
    """Hold an exclusive lock on ``name`` (any string) for the block; another holder makes it raise WorkspaceError.

    ``busy`` is the refusal's message, ``{pid}`` filled in with the holder's process id. The lock
    is ``flock`` on a file under the temp directory: the kernel releases it when its process ends,
    however it ends, so a killed run never leaves a stale lock behind.
    """
    import fcntl
    lock = _lock_dir() / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".lock")
    held = _HELD.get(str(lock))
    if held is not None:
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise WorkspaceError(busy.format(pid=pid)) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[str(lock)] = [fd, 1]
    try:
        yield
    finally:
        del _HELD[str(lock)]
        os.close(fd)  # releases the flock


def output_lock(path: str | Path, option: str = "--out"):
    """The one-writer lock of an output path (a link's target): a second concurrent writer is refused in one line."""
    target = resolve_output(path).absolute()
    return exclusive_lock(f"output:{os.path.normpath(target)}",
                          f"{option} '{path}' is being written by another workbench run (process {{pid}}); wait for it "
                          f"to finish, or choose another {option}")


def check_output_dir(path: str | Path, kind: str, option: str = "--out") -> Path:
    """Return where a ``kind`` step may write ``path`` (a link's target); else raise WorkspaceError saying why."""
    p = resolve_output(path)
    if not p.exists() and not p.is_symlink():
        return p
    if not p.is_dir():
        raise WorkspaceError(f"{option} '{p}' is a file; name a new or empty directory")
    if not any(p.iterdir()):
        return p
    problem = _output_problem(p, kind)
    if problem:
        raise WorkspaceError(f"{option} '{p}' {problem}; name a new or empty directory, or move those files away "
                             f"(only a complete earlier {kind} output is replaced)")
    return p


def write_output_manifest(directory: Path, kind: str, extra: Mapping | None = None) -> dict:
    """Write ``directory/manifest.json``: the kind, library versions and every file with its size and hash."""
    files = {f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": file_sha256(f)}
             for f in sorted(directory.rglob("*")) if f.is_file() and f.name != MANIFEST}
    manifest = {"format": kind, **(dict(extra) if extra else {}), "versions": library_versions(), "files": files}
    atomic_write_json(directory / MANIFEST, manifest)
    return manifest


def apply_umask(root: Path) -> None:
    """One permission rule for every output: what the user's umask gives a new file or directory.

    Temporary directories (mkdtemp) and some writers (safetensors) create private 0700 / 0600 entries;
    an output is an ordinary file of the user's, so directories get 0777 and files 0666 (0777 where
    executable) less the umask, whichever step wrote them.
    """
    mask = _umask()
    for d, _dirs, files in os.walk(root):
        os.chmod(d, 0o777 & ~mask)
        for name in files:
            f = os.path.join(d, name)
            if not os.path.islink(f):
                os.chmod(f, (0o777 if os.stat(f).st_mode & 0o100 else 0o666) & ~mask)


def swap_into_place(src: Path, dst: Path) -> Path:
    """Move the finished directory ``src`` to ``dst``, replacing what ``dst`` held only once ``src`` is whole."""
    src, dst = Path(src), resolve_output(dst)
    apply_umask(src)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        if old.is_symlink() or not old.is_dir():
            old.unlink()
        else:
            shutil.rmtree(old)
    else:
        os.replace(src, dst)
    return dst


def _remove_stale_staging(out: Path) -> None:
    """Remove what killed runs staged for ``out`` (their process is gone); a running one's is left alone."""
    import glob
    stale = [(d, d.name[len(f".{out.name}.partial-"):].split("-", 1)[0])
             for d in out.parent.glob(f".{glob.escape(out.name)}.partial-*-*")]
    stale += [(d, d.name.rsplit("-", 1)[-1]) for d in out.parent.glob(f".{glob.escape(out.name)}.old-*")]
    for d, pid in stale:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass  # alive, under another user


@contextmanager
def staged_output(path: str | Path, kind: str, option: str = "--out"):
    """Yield a hidden sibling directory to write a ``kind`` output into; swap it into ``path`` on success.

    The refusal comes before any work; on an exception (a failed evaluation, Ctrl-C) the staged
    directory is removed and ``path`` is left as it was. A manifest is added if the step wrote none.

        with staged_output(args.out, "workbench-onnx-export") as tmp:
            export_onnx(lm, tmp)
    """
    with output_lock(path, option):
        out = check_output_dir(path, kind, option)
        created = make_parents(out)
        _remove_stale_staging(out)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-{os.getpid()}-"))
        try:
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; once swapped in it is an ordinary directory
            yield tmp
            if not (tmp / MANIFEST).is_file():
                write_output_manifest(tmp, kind)
            check_output_dir(out, kind, option)  # still ours to replace after the (possibly long) step
            swap_into_place(tmp, out)
        except BaseException as e:
            full = storage_error(e, tmp, out, f"give {option} on another disk") if isinstance(e, Exception) else None
            if full is None and isinstance(e, WorkbenchError) and str(tmp) in str(e):
                with contextlib.suppress(TypeError):  # a message naming the staging folder names --out instead
                    full = type(e)(str(e).replace(str(tmp), str(out)))
            shutil.rmtree(tmp, ignore_errors=True)
            remove_empty(created)
            if full is not None:  # a full disk or a file-size limit, the file named: not a bug's traceback
                raise full from None
            raise


def _newest_file(folder: Path) -> Path | None:
    """The file written last under ``folder`` (the one a failed write was filling), or None; among files of the
    same time stamp (a coarse file-system clock) the largest, which a size limit stopped."""
    newest = None
    for f in folder.rglob("*"):
        with contextlib.suppress(OSError):
            st = f.stat()
            if f.is_file() and (newest is None or (st.st_mtime_ns, st.st_size) > newest[0]):
                newest = ((st.st_mtime_ns, st.st_size), f)
    return newest and newest[1]


def storage_error(e: BaseException, folder: Path, shown: Path | None = None,
                  other_disk: str | None = None) -> WorkspaceError | None:
    """A one-line error for a write into ``folder`` that failed on a full disk, a quota or a file-size limit
    (``errors.storage_failure``), naming the file (the error's own, else the newest under ``folder``; as it would
    be under ``shown`` once in place), or None for any other failure."""
    found = storage_failure(e)
    if found is None:
        return None
    code, name = found
    path = Path(name) if name else _newest_file(Path(folder))
    if path is not None and shown is not None:
        with contextlib.suppress(ValueError):
            path = Path(shown) / path.relative_to(folder)
    if path is not None and path.suffix == ".partial":  # a writer's own temporary name (onnx export's data)
        path = path.with_suffix("")
    where = f"'{path}'" if path is not None else f"into '{shown or folder}'"
    return WorkspaceError(storage_message(code, where, other_disk))


def make_parents(out: Path) -> list[Path]:
    """Create ``out``'s missing parent directories; returns them, deepest first, for ``remove_empty``."""
    created, d = [], Path(out).parent
    while not d.exists() and d != d.parent:
        created.append(d)
        d = d.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    return created


def remove_empty(created: list[Path]) -> None:
    """Remove the directories ``make_parents`` created, where they are still empty: a failed step leaves none."""
    for d in created:
        with contextlib.suppress(OSError):
            d.rmdir()


def rebase_paths(obj, old: Path, new: Path):
    """``obj`` (paths, strings, lists, dicts, dataclasses) with every path under ``old`` moved under ``new``.

    A step run in a staged directory reports the staged paths; this turns them into the final ones.
    """
    import dataclasses
    old_s, new_s = str(old), str(new)
    if isinstance(obj, Path):
        return Path(rebase_paths(str(obj), old, new))
    if isinstance(obj, str):
        return new_s + obj[len(old_s):] if obj == old_s or obj.startswith(old_s + os.sep) else obj.replace(
            old_s + os.sep, new_s + os.sep)
    if isinstance(obj, Mapping):
        return type(obj)((k, rebase_paths(v, old, new)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebase_paths(v, old, new) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: rebase_paths(getattr(obj, f.name), old, new)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _canonical(obj):
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "to_dict"):
        return _canonical(obj.to_dict())
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


def hash_inputs(inputs: Mapping) -> str:
    """A short stable key for a dict of inputs (order-independent)."""
    blob = json.dumps(_canonical(inputs), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_fingerprint(model) -> str:
    """A hash of the model's parameter and buffer names, shapes, dtypes and bytes (as it is in memory).

    What every cached step keys a model by (calibration, sweeps, quantization, importance): a cache
    entry made for one model is never reused for another, or for the same one after its weights changed.
    """
    import torch

    h = hashlib.sha256()
    seen = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions that decide whether a cached artifact is still what a rerun would produce."""
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": platform.python_version()}
    for pkg in ("workbench", "torch", "transformers", "onnx", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


@dataclass(frozen=True)
class Artifact:
    """A complete artifact directory and its manifest."""

    step: str
    key: str
    path: Path
    manifest: dict

    def file(self, name: str) -> Path:
        p = self.path / name
        if not p.exists():
            raise WorkspaceError(f"artifact {self.step}/{self.key} has no file '{name}'")
        return p

    @property
    def result(self) -> dict:
        """The JSON-able summary the step returned (``manifest['result']``)."""
        return self.manifest.get("result") or {}

    def verify(self) -> None:
        """Re-hash every file and compare with the manifest."""
        for name, meta in self.manifest.get("files", {}).items():
            p = self.path / name
            if not p.is_file() or p.stat().st_size != meta["size"] or file_sha256(p) != meta["sha256"]:
                raise WorkspaceError(f"artifact {self.step}/{self.key}: file '{name}' is missing or changed; "
                                     f"delete {self.path} to recompute it")


class Workspace:
    """A directory of step artifacts keyed by the hash of their inputs."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else DEFAULT_WORKSPACE

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def key(self, inputs: Mapping) -> str:
        return hash_inputs(inputs)

    def path(self, step: str, key: str) -> Path:
        return self.root / step / key

    def partial_path(self, step: str, key: str) -> Path:
        return self.root / step / f".partial-{key}"

    def find(self, step: str, inputs_or_key: Mapping | str) -> Artifact | None:
        key = inputs_or_key if isinstance(inputs_or_key, str) else self.key(inputs_or_key)
        p = self.path(step, key)
        mf = p / MANIFEST
        if not mf.is_file():
            return None
        return Artifact(step, key, p, json.loads(mf.read_text()))

    def list(self, step: str | None = None) -> list[Artifact]:
        steps = [step] if step else sorted(d.name for d in self.root.iterdir() if d.is_dir()) \
            if self.root.is_dir() else []
        out = []
        for s in steps:
            d = self.root / s
            for k in sorted(x.name for x in d.iterdir()) if d.is_dir() else []:
                if not k.startswith(".") and (a := self.find(s, k)):
                    out.append(a)
        return out

    def get_or_compute(self, step: str, inputs: Mapping, compute: Callable[[Path], Mapping | None], *,
                       upstream: Iterable[Artifact | str] = (), force: bool = False) -> Artifact:
        """Return the artifact for ``inputs``, computing it with ``compute(partial_dir)`` if absent.

        ``compute`` writes its files into the directory it is given (which may already hold what
        an interrupted earlier run left there, for resuming) and may return a JSON-able summary,
        stored as ``manifest['result']``.
        """
        key = self.key(inputs)
        if not force and (found := self.find(step, key)):
            return found
        with exclusive_lock(f"workspace:{os.path.normpath(self.root.absolute())}/{step}/{key}",
                            f"another workbench run (process {{pid}}) is computing this {step} result in workspace "
                            f"'{self.root}'; wait for it to finish, then run again to read its result back"):
            if not force and (found := self.find(step, key)):
                return found  # the other run finished while this one waited for the lock
            return self._compute(step, key, inputs, compute, upstream)

    def _compute(self, step, key, inputs, compute, upstream) -> Artifact:
        partial = self.partial_path(step, key)
        try:
            partial.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WorkspaceError(f"the workspace '{self.root}' cannot be used ({e.strerror} at '{e.filename}'): set "
                                 "WORKBENCH_WORKSPACE (or --workspace) to a directory you can write, or leave it unset "
                                 "for ./workspace") from None
        try:
            result = compute(partial)
            files = {}
            for f in sorted(partial.rglob("*")):
                if f.is_file() and f.name != MANIFEST:
                    rel = f.relative_to(partial).as_posix()
                    files[rel] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
            manifest = {
                "step": step, "key": key, "inputs": _canonical(inputs),
                "upstream": [a.key if isinstance(a, Artifact) else str(a) for a in upstream],
                "versions": library_versions(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": files, "result": _canonical(dict(result)) if result else {},
            }
            atomic_write_json(partial / MANIFEST, manifest)
        except Exception as e:
            full = storage_error(e, partial, other_disk="set WORKBENCH_WORKSPACE to a folder on another disk")
            if full is not None:  # the partial folder stays: a rerun resumes from it
                raise full from None
            raise
        final = self.path(step, key)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        return Artifact(step, key, final, manifest)

    def remove(self, step: str, key: str) -> None:
        for p in (self.path(step, key), self.partial_path(step, key)):
            if p.exists():
                shutil.rmtree(p)
