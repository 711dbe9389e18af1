"""Text in and numbers out: bounded reading and tokenizing of text files (``textio``), calibration /
fine-tune / evaluation sets (``data``), and perplexity, KL and top-1 against a reference (``evaluate``).
Images in: bounded, fully decoded RGB pictures and image + text sets (``images``), and a vision-language
model's image-conditioned KL, top-1 and image-text matching against its float reference (``vision``).

May import: ``numerics``, ``files`` and the root basics.
"""
