"""What every step panel shares: a status line with its progress bar, a log, frozen controls while working, figures.

A panel subclasses ``StepPanel``, calls ``self._setup()`` before building its widgets, places
``self.status_line`` under its button, lists its inputs in ``self.controls`` and wraps its work in
``self._attempt(message, work)``: controls are disabled while it runs, library output goes to the log
widget, the library's progress bars drive the line's ipywidgets bar (and a short text after the
message), and bad input becomes a red status line (and ``panel.error``) instead of a traceback.
Status lines joined in one ``StatusGroup`` (the app's) are cleared when another action of the group
succeeds, so no message outlives the next step. ``self._watch(session, handler, names)`` observes a
shared object until the panel closes.
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
from ..units import format_bytes
from ..charts.style import METRIC_WORDS

__all__ = ["StepPanel", "StatusLine", "StatusGroup", "CheckList", "FileDownload", "progress_into", "ruled_style", "ruled_table",
           "placeholder_html", "metric_words_html", "file_error"]

T = TypeVar("T")
W = TypeVar("W", bound=widgets.Widget)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # tqdm moves the cursor between nested bars


def metric_words_html(*terms: str) -> str:
    """One grey line saying what each quality figure (``charts.style.METRIC_WORDS``: KL, nats, top-1, perplexity)
    means, each term with its meaning as its hover text too."""
    parts = [f"<span title='{html.escape(METRIC_WORDS[t])}'>{html.escape(METRIC_WORDS[t])}</span>"
             for t in (terms or METRIC_WORDS)]
    return "<div class='workbench-words' style='font-size:11px;color:#5d6d7e'>" + "; ".join(parts) + "</div>"


def placeholder_html(what: str) -> str:
    """A grey line standing where a chart will be, saying what it will show and what draws it (an empty chart
    frame before any data read as broken)."""
    return f"<div class='workbench-placeholder' style='font-size:12px;color:#7f8c8d;padding:6px 0'>{html.escape(what)}</div>"


def file_error(e: OSError) -> str:
    """A file or folder the app cannot create, read or write, in one line: which, and why (an output folder in a
    read-only place was a ``Path.mkdir`` traceback on the page)."""
    reason = e.strerror or type(e).__name__
    hint = " (choose an output folder you can write to)" if isinstance(e, (PermissionError, IsADirectoryError)) or \
        e.errno in (13, 20, 30) else ""
    return f"cannot use '{e.filename}': {reason.lower() if reason[:1].isupper() else reason}{hint}"


def ruled_style(cls: str) -> str:
    """A ``<style>`` that makes a table of class ``cls`` read in columns: cell borders, padding, a shaded header."""
    return (f"<style>.{cls}{{border-collapse:collapse;font-size:12px}}.{cls} td,.{cls} th{{border:1px solid #ddd;"
            f"padding:2px 6px;text-align:left;vertical-align:top}}.{cls} th{{background:#f4f6f7}}</style>")


def ruled_table(cls: str, head: str, rows: str) -> str:
    """An HTML table of class ``cls`` in ``ruled_style`` (``head``: the header row's ``<th>`` cells; ``rows``: the
    ``<tr>`` rows)."""
    return f"{ruled_style(cls)}<table class='{cls}'><tr>{head}</tr>{rows}</table>"


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
def progress_into(show: Callable[[str], None],
                  count: Callable[[int, float | None, str], None] | None = None) -> Iterator[None]:
    """While inside, the library's ``tqdm.auto`` bars are text lines given to ``show``; the outermost open
    bar's count goes to ``count(n, total, description)`` (what a panel's progress bar shows).

    In a kernel ``tqdm.auto`` draws ipywidgets bars; those the library opens with ``leave=False`` close
    their widget when done, and an Output widget that captured them during a button press then shows
    "Error displaying widget: model not found" (or "Loading widget..." forever) in their place. The
    library imports ``tqdm.auto`` inside its functions, so swapping the attribute here reaches it.
    """
    import tqdm.auto
    import tqdm.autonotebook
    from tqdm.std import tqdm as std_tqdm

    writer = _LineWriter(show)
    open_bars: list = []  # the first is the outermost: nested bars (a layer's passes) do not move the widget

    class LineTqdm(std_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = writer
            kwargs.setdefault("ncols", 90)
            super().__init__(*args, **kwargs)
            if not self.disable:
                open_bars.append(self)
                self._count()

        def _count(self) -> None:
            if count is not None and open_bars and open_bars[0] is self:
                count(self.n, self.total, self.desc or "")

        def update(self, n=1):
            shown = super().update(n)
            self._count()  # every step: the text line refreshes at most ten times a second, the bar need not wait
            return shown

        def display(self, msg=None, pos=None):
            shown = super().display(msg, pos)
            self._count()
            return shown

        def close(self):
            if not self.disable and self in open_bars:
                self._count()
                open_bars.remove(self)
            super().close()

    saved = tqdm.auto.tqdm, tqdm.autonotebook.tqdm
    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = LineTqdm
    try:
        yield
    finally:
        tqdm.auto.tqdm, tqdm.autonotebook.tqdm = saved


class StatusGroup:
    """Status lines of one app: an action that succeeds on one clears the others' earlier messages."""

    def __init__(self):
        self.lines: list[StatusLine] = []

    def add(self, line: "StatusLine") -> "StatusLine":
        if line not in self.lines:
            self.lines.append(line)
            line.group = self
        return line

    def succeeded(self, line: "StatusLine") -> None:
        for other in self.lines:
            if other is not line and not other.busy:
                other.clear()


class StatusLine(widgets.HBox):
    """One action's status, placed under its button: a progress bar (shown while a library bar runs) and a line."""

    def __init__(self, bar_width: str = "260px"):
        self.html = widgets.HTML()
        # its label, the library bar's name (18 characters at most, the rest in the tooltip), is shown whole
        self.bar = widgets.IntProgress(value=0, min=0, max=1, layout={"width": bar_width, "display": "none"},
                                       style={"bar_color": "#2e86c1", "description_width": "initial"})
        self.group: StatusGroup | None = None
        self.busy = False
        super().__init__([self.bar, self.html], layout={"align_items": "center"})
        self.add_class("workbench-status")

    def count(self, n: int, total: float | None, desc: str) -> None:
        """Move the bar to ``n`` of ``total`` (an unknown total leaves it pulsing at full)."""
        self.bar.layout.display = ""
        self.bar.max = max(int(total or 0), 1)
        self.bar.value = min(int(n), self.bar.max) if total else self.bar.max
        self.bar.bar_style = "" if total else "info"
        self.bar.description = desc[:18]
        self.bar.tooltip = f"{desc} {n}/{int(total) if total else '?'}"

    def hide_bar(self) -> None:
        self.bar.layout.display = "none"

    def clear(self) -> None:
        self.html.value = ""
        self.hide_bar()

    def succeeded(self) -> None:
        if self.group is not None:
            self.group.succeeded(self)


class CheckList(widgets.VBox):
    """Several choices as a titled grid of checkboxes (no Ctrl-click): ``value`` is the tuple of chosen keys of
    ``options`` (``[(label, key), ...]``), in the order given (a box ticked later comes last); ``disabled`` freezes
    every box."""

    value = traitlets.Tuple()
    disabled = traitlets.Bool(False)

    def __init__(self, options, value=(), *, description: str = "", columns: int = 2, width: str = "210px"):
        self.options = [(str(label), key) for label, key in options]
        self.boxes = {key: widgets.Checkbox(value=False, description=label, indent=False,
                                            layout={"width": width, "margin": "0"})
                      for label, key in self.options}
        grid = widgets.GridBox(list(self.boxes.values()), layout={
            "grid_template_columns": f"repeat({columns}, {width})", "grid_gap": "0 8px"})
        head = [widgets.HTML(f"<b>{html.escape(description)}</b>")] if description else []
        super().__init__([*head, grid])
        self.add_class("workbench-checklist")
        self._syncing = False
        for box in self.boxes.values():
            box.observe(self._from_boxes, names="value")
        self.value = tuple(value)

    @traitlets.validate("value")
    def _valid(self, proposal):
        chosen = tuple(dict.fromkeys(proposal["value"]))
        unknown = [k for k in chosen if k not in self.boxes]
        if unknown:
            raise traitlets.TraitError(f"not among the choices: {', '.join(map(str, unknown))}")
        return chosen

    @traitlets.observe("value")
    def _to_boxes(self, change) -> None:
        self._syncing = True
        try:
            for key, box in self.boxes.items():
                box.value = key in change["new"]
        finally:
            self._syncing = False

    @traitlets.observe("disabled")
    def _freeze(self, change) -> None:
        for box in self.boxes.values():
            box.disabled = change["new"]

    def _from_boxes(self, _change) -> None:
        if not self._syncing:  # the boxes still ticked keep their place, a newly ticked one comes last
            ticked = [k for k, box in self.boxes.items() if box.value]
            self.value = tuple(k for k in self.value if k in ticked) + tuple(k for k in ticked if k not in self.value)


class StepPanel(widgets.VBox):
    """Base for the step panels (``CalibratePanel``, ``QuantizePanel``, ``GraphPanel``, ...)."""

    def _setup(self, log_height: str = "160px") -> None:
        self.error: str | None = None
        self.figures: dict = {}  # the figures on show, by name; tests read them without a browser
        self.controls: list[widgets.Widget] = []
        self._on_close: list[Callable[[], None]] = []
        self.status_line = StatusLine()
        self.status = self.status_line.html  # the text of the line; panels set it after a result
        self.log_output = widgets.Output(layout={"border": "1px solid #ddd", "max_height": log_height,
                                                 "overflow": "auto"})

    def _freeze(self, frozen: bool) -> None:
        for w in self.controls:
            w.disabled = frozen

    def _show_error(self, error: Exception | str, line: StatusLine | None = None) -> None:
        self.error = str(error)
        line = line or self.status_line
        line.hide_bar()
        line.html.value = f"<span style='color:#c0392b'>error: {html.escape(self.error)}</span>"

    def _attempt(self, message: str, work: Callable[[], T], line: StatusLine | None = None) -> tuple[bool, T | None]:
        """Run ``work`` with controls frozen and output captured; ``(False, None)`` on bad input.

        ``line``: the status line beside the button that asked (default the panel's own)."""
        line = line or self.status_line
        self._freeze(True)
        self.error = None
        line.busy = True
        line.hide_bar()
        line.html.value = html.escape(message)

        def show(text: str) -> None:
            line.html.value = f"{html.escape(message)} <span style='color:#5d6d7e'>{html.escape(text)}</span>"
        refused = None
        try:
            with self.log_output, progress_into(show, line.count):
                try:
                    result = work()
                    line.hide_bar()
                    line.succeeded()
                    return True, result
                except (WorkbenchError, ValueError) as e:
                    refused = e
                except OSError as e:
                    if e.filename is None:
                        raise  # not about a file or folder: the traceback, in the log
                    refused = file_error(e)
            # reached without ``refused`` when the output widget showed an unexpected exception's traceback:
            # in a kernel it keeps exceptions to itself
            self._show_error(refused or "unexpected error: its traceback is in the log below", line)
            return False, None
        finally:
            line.busy = False
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

    ``send_file(path)`` sends the bytes once, in pieces of ``chunk_bytes`` (binary messages): the page shows
    "receiving NAME: k of n MB" as they arrive, then saves them under the file's name and keeps a link to save
    them again. One message of a whole 181 MB zip froze the page for 45 s with no sign of progress. Nothing is
    kept in the widget's state.
    """

    _esm = """
    function render({ model, el }) {
      const note = document.createElement("span");
      note.className = "workbench-download-progress";
      note.style.cssText = "font-size:12px;color:#5d6d7e;display:none";
      const link = document.createElement("a");
      link.className = "workbench-download-link";
      link.style.display = "none";
      el.appendChild(note);
      el.appendChild(link);
      let parts = [], got = 0, file = null;
      const mb = (n) => (n / 1e6).toFixed(1);
      model.on("msg:custom", (msg, buffers) => {
        if (!msg) return;
        if (msg.kind === "forget") {  // a new model: the last run's file is not this run's
          if (link.href) URL.revokeObjectURL(link.href);
          link.removeAttribute("href");
          link.textContent = "";
          link.style.display = "none";
          note.style.display = "none";
          parts = []; got = 0; file = null;
          return;
        }
        if (msg.kind === "start") {
          file = msg; parts = []; got = 0;
          link.style.display = "none";  // the last file's link is not this one's
          note.textContent = `receiving ${msg.name}: 0 of ${mb(msg.bytes)} MB`;
          note.style.display = "";
          return;
        }
        if (msg.kind === "chunk" && file && msg.name === file.name) {
          parts.push(...buffers);
          got += buffers.reduce((n, b) => n + b.byteLength, 0);
          note.textContent = `receiving ${file.name}: ${mb(got)} of ${mb(file.bytes)} MB`;
          return;
        }
        if (msg.kind === "end" && file && msg.name === file.name) {
          const blob = new Blob(parts, { type: file.mime });
          parts = [];
          if (link.href) URL.revokeObjectURL(link.href);
          link.href = URL.createObjectURL(blob);
          link.download = file.name;
          link.textContent = `save ${file.name} again (${file.size})`;
          link.style.display = "";
          note.style.display = "none";
          file = null;
          link.click();
        }
      });
    }
    export default { render };
    """
    sent = traitlets.Unicode("").tag(sync=True)  # the name of the last file sent, for tests and the page
    chunk_bytes = 4 << 20  # one binary message each: small enough for the page to show progress between them

    def send_file(self, path: str | Path, mime: str = "application/zip") -> int:
        """Send ``path`` to the page in pieces; the number of bytes sent."""
        path = Path(path)
        total = path.stat().st_size
        self.send({"kind": "start", "name": path.name, "mime": mime, "bytes": total, "size": format_bytes(total)})
        with path.open("rb") as f:
            while chunk := f.read(self.chunk_bytes):
                self.send({"kind": "chunk", "name": path.name}, buffers=[chunk])
        self.send({"kind": "end", "name": path.name})
        self.sent = path.name
        return total

    def forget(self) -> None:
        """Take the "save again" link off the page: the file it saves belongs to an earlier run."""
        self.send({"kind": "forget"})
        self.sent = ""
