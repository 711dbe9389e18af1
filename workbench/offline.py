"""Nothing the workbench calls phones home: the settings each dependency reads, set before it is imported.

onnxruntime (1.32) sends DNS queries for its telemetry host about 20 s into a process unless
``ORT_DISABLE_TELEMETRY`` is set before it loads; the Hugging Face libraries look for a model hub
and send usage data unless told they are offline. ``workbench/__init__.py`` applies these to the
process (a value the user set is kept), and the app server passes them to its kernels.
"""
from __future__ import annotations

import os
from typing import MutableMapping

__all__ = ["OFFLINE_ENV", "apply_offline_env"]

OFFLINE_ENV = {
    "ORT_DISABLE_TELEMETRY": "1",  # onnxruntime's own telemetry (native code: no Python hook sees it)
    "HF_HUB_OFFLINE": "1",  # huggingface_hub: never reach the hub
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    "DO_NOT_TRACK": "1",  # the cross-tool convention (huggingface_hub, gradio and others read it)
}


def apply_offline_env(environ: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set every ``OFFLINE_ENV`` entry not already set in ``environ`` (default ``os.environ``); returns it."""
    env = os.environ if environ is None else environ
    for name, value in OFFLINE_ENV.items():
        env.setdefault(name, value)
    return env
