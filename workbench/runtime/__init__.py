"""Runners below the targets: ``onnx_runner`` (``OnnxCausalLM``, an exported graph pair run in onnxruntime,
and the graphs' input names), ``stream`` (the token loop, sampling, torch threads) and ``parity`` (PyTorch
against another runtime). Which runner opens a folder is ``workbench.run.locate``.

May import: ``numerics``, ``files`` and the root basics.
"""
