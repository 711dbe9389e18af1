"""Running what the workbench wrote: the onnxruntime runner, the token loop, the parity checks.

Import the modules themselves (``workbench.runtime.onnx_runner``, ``.stream``, ``.parity``).
"""
