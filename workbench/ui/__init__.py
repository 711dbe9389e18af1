"""ipywidgets panels, one module per step. Panels call the library; they hold no torch code or file I/O."""
