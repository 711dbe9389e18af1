"""Devices without running on them: device profiles (``profiles``), the LLM runtimes a device runs
(``runtimes``), the fits to the vendors' own measurements (``vendor_fit``) and the projection of a
plan's speed and memory (``projection``).

May import: ``model`` and the layers below it.
"""
