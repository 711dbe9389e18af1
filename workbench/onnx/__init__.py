"""ONNX graphs of a causal LM: ``build`` writes them op by op, ``export`` exports and checks a model,
``inspect`` reads them back (operators, weight bytes, what a decode step reads).

Import the modules themselves (``workbench.onnx.export``, ...); this package file imports nothing, so
reading a graph does not load PyTorch.
"""
