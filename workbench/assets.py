"""Where the bundled files live: the demo model, its texts, the device and target tables.

Imports nothing from the package, so any module can find the assets without pulling in the model
loader (``workbench.model.load``) and what it imports.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["ASSETS_DIR", "DEMO_MODEL_DIR", "DEMO_VL_MODEL_DIR", "DEMO_VL_DATA_DIR", "demo_text_path"]

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEMO_MODEL_DIR = ASSETS_DIR / "demo-model"
DEMO_VL_MODEL_DIR = ASSETS_DIR / "demo-vl-model"  # the demo vision-language model (scripts/build_demo_vl_model.py)
DEMO_VL_DATA_DIR = ASSETS_DIR / "demo-vl"  # its held-out pictures, questions, captions and calibration pairs


def demo_text_path(kind: str) -> Path:
    """The bundled ``heldout`` evaluation text or ``calibration`` text of the demo model."""
    if kind not in ("heldout", "calibration"):
        raise ValueError(f"kind must be 'heldout' or 'calibration', not {kind!r}")
    return DEMO_MODEL_DIR / f"{kind}.txt"
