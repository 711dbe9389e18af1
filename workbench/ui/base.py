"""What every step panel shares: a status line, a log, frozen controls while working, figures.

A panel subclasses ``StepPanel``, calls ``self._setup()`` before building its widgets, lists its
inputs in ``self.controls`` and wraps its work in ``self._attempt(message, work)``: controls are
disabled while it runs, library output goes to the log widget, library progress bars become one line
after the status message, and bad input becomes a red status line (and ``panel.error``) instead of a
traceback. ``self._watch(session, handler, names)`` observes a shared object until the panel closes.
"""
from __future__ import annotations

import contextlib
import html
import io
import re
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import anywidget
import ipywidgets as widgets
import traitlets
from IPython import get_ipython
from IPython.display import display

from ..errors import WorkbenchError

__all__ = ["StepPanel", "FileDownload", "progress_into"]

T = TypeVar("T")
W = TypeVar("W", bound=widgets.Widget)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # tqdm moves the cursor between nested bars


def _in_widget_callback() -> bool:
    """True while the kernel handles a widget message (a button press), not a cell execution."""
    kernel = getattr(get_ipython(), "kernel", None)
    try:
        return kernel.get_parent()["header"]["msg_type"] == "comm_msg"
    except Exception:  # noqa: BLE001 - no kernel, or an ipykernel without get_parent: not a callback
        return False


class _LineWriter(io.TextIOBase):
    """A file for tqdm that hands each refreshed bar, as one line of text, to ``show``."""

    def __init__(self, show: Callable[[str], None]):
        super().__init__()
        self._show = show

    def write(self, s: str) -> int:
        lines = [line.strip() for line in _ANSI.sub("", s).replace("\r", "\n").split("\n") if line.strip()]
        if lines:
            self._show(lines[-1])
        return len(s)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def progress_into(show: Callable[[str], None]) -> Iterator[None]:
    """While inside, the library's ``tqdm.auto`` bars are text lines given to ``show``.

    In a kernel ``tqdm.auto`` draws ipywidgets bars; those the library opens with ``leave=False`` close
    their widget when done, and an Output widget that captured them during a button press then shows
    "Error displaying widget: model not found" (or "Loading widget..." forever) in their place. The
    library imports ``tqdm.auto`` inside its functions, so swapping the attribute here reaches it.
    """
    import tqdm.auto
    import tqdm.autonotebook
    from tqdm.std import tqdm as std_tqdm

    writer = _LineWriter(show)

    class LineTqdm(std_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = writer
            kwargs.setdefault("ncols", 90)
            super().__init__(*args, **kwargs)

    saved = tqdm.auto.tqdm, tqdm.autonotebook.tqdm
    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = LineTqdm
    try:
        yield
    finally:
        tqdm.auto.tqdm, tqdm.autonotebook.tqdm = saved


class StepPanel(widgets.VBox):
    """Base for the step panels (``CalibratePanel``, ``QuantizePanel``, ``GraphPanel``, ...)."""

    def _setup(self, log_height: str = "160px") -> None:
        self.error: str | None = None
        self.figures: dict = {}  # the figures on show, by name; tests read them without a browser
        self.controls: list[widgets.Widget] = []
        self._on_close: list[Callable[[], None]] = []
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

        def show(line: str) -> None:
            self.status.value = f"{html.escape(message)} <span style='color:#5d6d7e'>{html.escape(line)}</span>"
        refused = None
        try:
            with self.log_output, progress_into(show):
                try:
                    return True, work()
                except (WorkbenchError, ValueError) as e:
                    refused = e
            # reached without ``refused`` when the output widget showed an unexpected exception's traceback:
            # in a kernel it keeps exceptions to itself
            self._show_error(refused or "unexpected error: its traceback is in the log below")
            return False, None
        finally:
            self._freeze(False)

    def _watch(self, owner: traitlets.HasTraits, handler: Callable, names) -> None:
        """Observe ``owner`` (the app's session) for as long as this panel is open."""
        owner.observe(handler, names=names)
        self._on_close.append(lambda: owner.unobserve(handler, names=names))

    def _own(self, widget: W) -> W:
        """A child that watches something itself (a session label): closed with this panel."""
        self._on_close.append(widget.close)
        return widget

    def close(self):
        for undo in getattr(self, "_on_close", ()):
            undo()
        self._on_close = []
        super().close()

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


class FileDownload(anywidget.AnyWidget):
    """Hands a file from the kernel to the browser as a download (a Voila page has no file server).

    ``send_file(path)`` sends the bytes once, as a binary message; the page saves them under the
    file's name and keeps a link to save them again. Nothing is kept in the widget's state.
    """

    _esm = """
    function render({ model, el }) {
      const link = document.createElement("a");
      link.className = "workbench-download-link";
      link.style.display = "none";
      el.appendChild(link);
      model.on("msg:custom", (msg, buffers) => {
        if (!msg || msg.kind !== "file") return;
        const blob = new Blob(buffers, { type: msg.mime });
        if (link.href) URL.revokeObjectURL(link.href);
        link.href = URL.createObjectURL(blob);
        link.download = msg.name;
        link.textContent = `save ${msg.name} again (${msg.size})`;
        link.style.display = "";
        link.click();
      });
    }
    export default { render };
    """
    sent = traitlets.Unicode("").tag(sync=True)  # the name of the last file sent, for tests and the page

    def send_file(self, path: str | Path, mime: str = "application/zip") -> int:
        data = Path(path).read_bytes()
        size = f"{len(data) / 1e6:.1f} MB"
        self.send({"kind": "file", "name": Path(path).name, "mime": mime, "size": size}, buffers=[data])
        self.sent = Path(path).name
        return len(data)
