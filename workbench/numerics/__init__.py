"""Torch arithmetic the steps share: float32 compute on 16-bit weights (``compute``), resident memory and
its peak (``memory``), the output layer's logits without a float32 copy of it (``logits``).

May import: the root basics.
"""
