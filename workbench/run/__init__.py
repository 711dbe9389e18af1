"""Running what the workbench wrote, and comparing it: the seam from a folder to its target's runner
(``locate``), streaming text (``generate``), prefill / decode timing (``profile``), the
simulation-to-device gap (``devices_gap``) and where a graph departs from the simulation (``layerwise``).

May import: ``targets`` and the layers below it.
"""
