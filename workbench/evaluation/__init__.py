"""Text in and numbers out: bounded reading and tokenizing of text files (``textio``), calibration /
fine-tune / evaluation sets (``data``), and perplexity, KL and top-1 against a reference (``evaluate``).

May import: ``numerics``, ``files`` and the root basics.
"""
