"""Changing the weights themselves: LoRA fine-tuning (``finetune``), structured pruning (``prune``) and
distillation after pruning (``distill``).

May import: ``precision`` and the layers below it.
"""
