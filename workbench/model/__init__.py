"""The model: loading a float or quantized checkpoint and finding its layers (``load``; vision-language models
and their parts in ``vision``), its shapes without weights and the one byte accounting (``shapes``),
activation statistics (``calibrate``), and where a sweep's trials run (``sweep_backends``).

May import: ``quantize``, ``evaluation``, ``numerics``, ``files`` and the root basics.
"""
