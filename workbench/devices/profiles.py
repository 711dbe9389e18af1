"""Device profiles as data: what a phone, board or laptop chip can hold and how fast it can read.

    devices = load_devices()                       # assets/devices/*.json, then $WORKBENCH_DEVICES
    d = get_device("8gen3")                        # by file name, name or alias, any case
    d.memory_bandwidth_gbps, d.npu_int8_tops, d.source("npu_int8_tops")

One JSON file per device. Every figure is ``{"value": x, "source": "..."}`` (a vendor page title or a
FIELD.md line) or ``{"value": null, "reason": "..."}`` when no source gives it, so a projection can say
what it does not know instead of guessing. A user adds a device by dropping one file into a folder named
by ``WORKBENCH_DEVICES`` (``os.pathsep``-separated) or passed as ``dirs``; a file with a missing,
negative or unsourced field is refused, naming the file and the field.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

from ..assets import ASSETS_DIR
from ..errors import WorkbenchError

__all__ = ["DeviceError", "Device", "DEVICES_DIR", "NUMBER_FIELDS", "LIST_FIELDS", "load_device", "load_devices",
           "get_device", "replacement_note"]

DEVICES_DIR = ASSETS_DIR / "devices"
ENV_VAR = "WORKBENCH_DEVICES"
NUMBER_FIELDS = {  # field -> what it means (shown by `workbench devices`)
    "memory_bandwidth_gbps": "DRAM read bandwidth, GB/s (1e9 bytes/s)",
    "npu_int8_tops": "accelerator INT8 throughput, dense TOPS",
    "npu_fp16_tops": "accelerator FP16 throughput, dense TFLOPS",
    "ram_gb": "memory the model, KV cache and runtime share, GB (1e9 bytes)",
    "npu_memory_limit_gb": "largest graph / context the accelerator takes, GB (2^30 bytes, as QNN counts)",
}
LIST_FIELDS = {
    "weight_precisions": "weight precisions the accelerator computes with",
    "activation_precisions": "activation precisions the accelerator computes with",
}
TEXT_FIELDS = ("name", "device_class", "accelerator")
OPTIONAL_FIELDS = {  # field -> what it means; absent on devices without that accelerator
    "qnn_soc_model": "QNN's soc_model id of the Snapdragon (onnxruntime-qnn's HTP backend takes it)",
    "htp_arch": "Hexagon HTP generation (69 = v69, 73 = v73, ...): what the NPU computes",
}


class DeviceError(WorkbenchError):
    """A device profile file is missing, malformed, or has a missing, negative or unsourced field."""


@dataclass(frozen=True)
class Device:
    """One device profile; figures are None where no source gives them (``reason`` says why)."""

    key: str  # the file name without .json: what --device takes
    name: str
    device_class: str  # devices of one class share a fitted efficiency (projection.fit_efficiency)
    accelerator: str
    memory_bandwidth_gbps: float | None
    npu_int8_tops: float | None
    npu_fp16_tops: float | None
    ram_gb: float | None
    npu_memory_limit_gb: float | None
    weight_precisions: tuple[str, ...] | None
    activation_precisions: tuple[str, ...] | None
    aliases: tuple[str, ...] = ()
    qnn_soc_model: int | None = None  # OPTIONAL_FIELDS
    htp_arch: int | None = None
    sources: dict = field(default_factory=dict, compare=False)  # field -> {"source": ...} or {"reason": ...}
    path: Path | None = field(default=None, compare=False)
    replaces: "Device | None" = field(default=None, compare=False, repr=False)  # the profile of the same name it hides

    def source(self, name: str) -> str:
        """Where a figure comes from, or why it is unknown."""
        s = self.sources.get(name, {})
        return s.get("source") or f"unknown: {s.get('reason', 'no source')}"

    def names(self) -> tuple[str, ...]:
        return (self.key, self.name, *self.aliases)

    def to_dict(self) -> dict:
        d = {"key": self.key, "name": self.name, "device_class": self.device_class, "accelerator": self.accelerator,
             "aliases": list(self.aliases)}
        for f in (*NUMBER_FIELDS, *LIST_FIELDS):
            v = getattr(self, f)
            d[f] = {"value": list(v) if isinstance(v, tuple) else v, **self.sources.get(f, {})}
        for f in OPTIONAL_FIELDS:
            if getattr(self, f) is not None:
                d[f] = {"value": getattr(self, f), **self.sources.get(f, {})}
        return d


def load_device(path: str | os.PathLike) -> Device:
    """Read one profile, refusing it (naming the file and the field) when anything is missing or wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DeviceError(f"device file '{path}' cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DeviceError(f"device file '{path}' is not valid JSON ({e}); fix the file") from None
    if not isinstance(doc, dict):
        raise DeviceError(f"device file '{path}' must hold one JSON object")

    def bad(fieldname: str, what: str) -> DeviceError:
        return DeviceError(f"device file '{path}': field '{fieldname}' {what}")

    for f in TEXT_FIELDS:
        if not isinstance(doc.get(f), str) or not doc[f].strip():
            raise bad(f, "is missing" if f not in doc else "must be a non-empty string")
    aliases = doc.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise bad("aliases", "must be a list of strings")
    values, sources = {}, {}
    for f in (*NUMBER_FIELDS, *LIST_FIELDS):
        if f not in doc:
            raise bad(f, 'is missing: give {"value": ..., "source": "..."} or {"value": null, "reason": "..."}')
        entry = doc[f]
        if not isinstance(entry, dict) or "value" not in entry:
            raise bad(f, 'must be an object {"value": ..., "source": "..."}')
        value = entry["value"]
        if value is None:
            if not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
                raise bad(f, "is null without a 'reason' saying why it is unknown")
            sources[f] = {"reason": entry["reason"]}
        else:
            if not isinstance(entry.get("source"), str) or not entry["source"].strip():
                raise bad(f, "has no 'source' (a vendor page title or a FIELD.md line)")
            sources[f] = {"source": entry["source"]}
            if f in NUMBER_FIELDS:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise bad(f, f"must be a number, not {value!r}")
                if not math.isfinite(value):
                    raise bad(f, f"is {value}, not a figure; give the published one or null with a 'reason'")
                if value < 0:
                    raise bad(f, f"is negative ({value}); give the published figure")
                value = float(value)
            else:
                if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
                    raise bad(f, "must be a non-empty list of precision names such as \"int8\"")
                value = tuple(p.lower() for p in value)
        values[f] = value
    for f in OPTIONAL_FIELDS:
        if f not in doc:
            continue
        entry = doc[f]
        if not isinstance(entry, dict) or isinstance(entry.get("value"), bool) or not isinstance(entry.get("value"), int) \
                or entry["value"] <= 0:
            raise bad(f, 'must be an object {"value": <positive integer>, "source": "..."}')
        if not isinstance(entry.get("source"), str) or not entry["source"].strip():
            raise bad(f, "has no 'source' (a vendor page title, a FIELD.md line or the measurement)")
        values[f], sources[f] = entry["value"], {"source": entry["source"]}
    return Device(key=path.stem, name=doc["name"], device_class=doc["device_class"], accelerator=doc["accelerator"],
                  aliases=tuple(aliases), sources=sources, path=path, **values)


def _search_dirs(dirs: Iterable[str | os.PathLike] | None) -> list[Path]:
    if dirs is not None:
        return [Path(d) for d in dirs]
    extra = [Path(p) for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    return [DEVICES_DIR, *extra]


def load_devices(dirs: Iterable[str | os.PathLike] | None = None) -> dict[str, Device]:
    """Every profile in the bundled folder and the user's (``$WORKBENCH_DEVICES``); a later file of the same
    name replaces an earlier one, so a user can correct a bundled profile (``replaces`` keeps the one it hides, and
    ``get_device`` says so once, as a note)."""
    out: dict[str, Device] = {}
    for d in _search_dirs(dirs):
        if not d.is_dir():
            raise DeviceError(f"device folder '{d}' does not exist; create it or fix ${ENV_VAR}")
        for path in sorted(d.glob("*.json")):
            device = load_device(path)
            if device.key in out:
                device = replace(device, replaces=out[device.key])
            out[device.key] = device
    return out


_said: set = set()  # replacements already said in this process (get_device runs once per projection)


def replacement_note(device: Device) -> str | None:
    """One sentence when ``device`` is a user's file hiding a bundled (or earlier) profile of the same name, with the
    figures that differ: a wrong user file otherwise changes every projection silently."""
    old = device.replaces
    if old is None:
        return None
    changed = [f"{f} {getattr(device, f):g} (was {getattr(old, f):g})" if isinstance(getattr(device, f), (int, float))
               and isinstance(getattr(old, f), (int, float)) else f"{f} {getattr(device, f)} (was {getattr(old, f)})"
               for f in NUMBER_FIELDS if getattr(device, f) != getattr(old, f)]
    return (f"device '{device.key}' is read from {device.path}, which replaces {old.path}"
            + (": " + ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else "") if changed
               else " (same figures)") + f"; move that file out of ${ENV_VAR}'s folder to use the one it replaces")


def get_device(name: str, devices: dict[str, Device] | None = None) -> Device:
    """A profile by file name, name or alias (any case, spaces or dashes alike)."""
    devices = load_devices() if devices is None else devices

    def norm(s: str) -> str:
        return "".join(ch for ch in s.lower() if ch.isalnum())
    for device in devices.values():
        if norm(name) in {norm(n) for n in device.names()}:
            note = replacement_note(device)
            if note and device.path not in _said:
                _said.add(device.path)
                logging.getLogger("workbench").info(note)
            return device
    raise DeviceError(f"unknown device '{name}'; choose one of: {', '.join(sorted(devices))} "
                      f"(`workbench devices` lists them; add one as a JSON file in ${ENV_VAR})")
