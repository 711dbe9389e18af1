"""Files the steps write and read: the content-addressed workspace (input hashing, atomic writes, staged
outputs) and the rule that a folder's own file names stay inside it.

Modules: ``workspace``, ``folder_paths``. May import: the root basics (``errors``, ``units``, ``assets``).
"""
