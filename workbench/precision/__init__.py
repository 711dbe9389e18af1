"""Choosing precisions: per-layer sensitivity (``sensitivity``), the cheap proxy for it (``proxy``), the
automatic plan under a budget (``autoplan``), why a layer is hard (``layer_difficulty``), and the
per-layer precision files each target reads (``overrides``).

May import: ``run`` and the layers below it.
"""
