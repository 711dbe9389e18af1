"""What every step panel shares: a status line, a log, frozen controls while working, figures.

A panel subclasses ``StepPanel``, calls ``self._setup()`` before building its widgets, lists its
inputs in ``self.controls`` and wraps its work in ``self._attempt(message, work)``: controls are
disabled while it runs, library output goes to the log widget, and bad input becomes a red status
line (and ``panel.error``) instead of a traceback.
"""
from __future__ import annotations

import html
from typing import Callable, TypeVar

import ipywidgets as widgets
from IPython import get_ipython
from IPython.display import display

from ..errors import WorkbenchError

__all__ = ["StepPanel"]

T = TypeVar("T")


def _in_widget_callback() -> bool:
    """True while the kernel handles a widget message (a button press), not a cell execution."""
    kernel = getattr(get_ipython(), "kernel", None)
    try:
        return kernel.get_parent()["header"]["msg_type"] == "comm_msg"
    except Exception:  # noqa: BLE001 - no kernel, or an ipykernel without get_parent: not a callback
        return False


class StepPanel(widgets.VBox):
    """Base for the step panels (``CalibratePanel``, ``QuantizePanel``, ``GraphPanel``, ...)."""

    def _setup(self, log_height: str = "160px") -> None:
        self.error: str | None = None
        self.figures: dict = {}  # the figures on show, by name; tests read them without a browser
        self.controls: list[widgets.Widget] = []
        self.status = widgets.HTML()
        self.log_output = widgets.Output(layout={"border": "1px solid #ddd", "max_height": log_height,
                                                 "overflow": "auto"})

    def _freeze(self, frozen: bool) -> None:
        for w in self.controls:
            w.disabled = frozen

    def _show_error(self, error: Exception | str) -> None:
        self.error = str(error)
        self.status.value = f"<span style='color:#c0392b'>error: {html.escape(self.error)}</span>"

    def _attempt(self, message: str, work: Callable[[], T]) -> tuple[bool, T | None]:
        """Run ``work`` with controls frozen and output captured; ``(False, None)`` on bad input."""
        self._freeze(True)
        self.error = None
        self.status.value = html.escape(message)
        try:
            with self.log_output:
                return True, work()
        except (WorkbenchError, ValueError) as e:
            self._show_error(e)
            return False, None
        finally:
            self._freeze(False)

    def _plot(self, key: str, fig, out: widgets.Output) -> None:
        """Keep ``fig`` in ``self.figures`` and draw it where a front end can show it."""
        self.figures[key] = fig
        if get_ipython() is None:  # a script or a test: keep it in .figures only
            return
        if _in_widget_callback():
            # a button press: a front end is there to capture a display message, and Voila renders a
            # plotly figure only when it arrives this way (one set as the `outputs` trait stays blank)
            out.clear_output()
            with out:
                display(fig)
        else:
            # a cell being run (nbmake, a notebook, Voila's first render): `with out: display(fig)`
            # can wait on a front end that never answers, so the figure is set as the widget's state
            out.outputs = ()
            out.append_display_data(fig)
