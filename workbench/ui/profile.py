"""The profile panel: time every export or conversion below a folder; a table, the speed/size chart, and each
decode speed against this host's memory bound (its read bandwidth, measured once and cached in the workspace).

    panel = ProfilePanel("out/convert")
    panel.run()                       # what the Run button does; returns the RuntimeProfile list
    display(panel)

In the app (``session=``) the folder is where Export writes the session's quantized model's
conversions, and the figures are kept in the session for the run's archive.
"""
from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets

from ..charts.profile import make_profile_figure
from ..charts.projection import make_host_bound_figure
from ..run.profile import (DEFAULT_PROMPT_LENGTHS, RuntimeProfile, host_bandwidth, last_level_cache_bytes,
                           parse_prompt_lengths, profile_directory)
from ..units import format_bytes
from .base import StepPanel, ruled_table
from .session import SessionLabel

__all__ = ["ProfilePanel"]


def _rows(profiles: list[RuntimeProfile], read_gbps: float, cache_bytes: int | None = None) -> str:
    """The table: prefill per prompt length, decode against this host's memory bound (none for a decode graph that
    fits in the CPU's last-level cache: it is read from the cache, which memory bandwidth does not bound)."""
    lengths = sorted({n for p in profiles for n in p.prefill_ms})
    head = ("<th>model</th><th>runtime</th><th title='the files the runtime loads, MB = 10^6 bytes'>MB</th>"
            + "".join(f"<th>prefill, {n}-token prompt (ms)</th>" for n in lengths)
            + "<th>decode tok/s</th><th title='this host read bandwidth / bytes one decode step reads'>memory bound "
              "tok/s</th><th title='measured decode speed / the memory bound: at most 1'>share of the bound</th>"
              "<th title='resident memory the model added while it ran, MB = 10^6 bytes'>memory added (MB)</th>")
    rows = []
    for p in profiles:
        cells = "".join(f"<td>{p.prefill_ms[n]:.1f}</td>" if n in p.prefill_ms else "<td>-</td>" for n in lengths)
        dec = f"{p.decode_tokens_per_second:.0f}" if p.decode_tokens_per_second else "-"
        bound, frac = p.decode_bound(read_gbps, cache_bytes), p.fraction_of_bound(read_gbps, cache_bytes)
        if bound:
            dec += f"</td><td>{bound:.0f}</td><td>{frac:.2f}" if frac is not None else f"</td><td>{bound:.0f}</td><td>-"
        elif p.decode_bytes and cache_bytes and p.decode_bytes <= cache_bytes:
            dec += (f"</td><td colspan='2' title='read from the cache each step, not from memory'>none: its "
                    f"{format_bytes(p.decode_bytes)} decode graph fits in this CPU's {format_bytes(cache_bytes)} "
                    "cache</td>")
        else:
            dec += "</td><td>-</td><td>-"
        mem = f"{p.rss_added_mb:.0f}" if p.rss_added_mb is not None else "-"
        rows.append(f"<tr><td>{html.escape(p.name)}</td><td>{p.runtime}</td><td>{p.size_bytes / 1e6:.2f}</td>{cells}"
                    f"<td>{dec}</td><td>{mem}</td></tr>")
    return ruled_table("workbench-profiles", head, "".join(rows))


class ProfilePanel(StepPanel):
    """Folder, prompt lengths, threads; Run times every model found there."""

    def __init__(self, directory: str | Path | None = "out/convert", *, prompt_lengths=DEFAULT_PROMPT_LENGTHS,
                 threads: int = 1, repeats: int = 5, session=None, workspace=None):
        self.session = session
        if session is not None:
            directory = session.conversion_dir
            workspace = workspace or session.workspace
        self.workspace = workspace
        self.profiles: list[RuntimeProfile] = []
        self.host: dict | None = None  # this host's read bandwidth (host_bandwidth), once something was profiled
        self._setup()
        self.directory = widgets.Text(value=str(directory), description="folder", layout={"width": "560px"},
                                      placeholder="output of Export / workbench convert / workbench export")
        # "32, 128" with a space: "32,128" reads as thirty-two thousand
        self.prompt_lengths = widgets.Text(value=", ".join(map(str, prompt_lengths)), description="prompt tokens",
                                           style={"description_width": "initial"}, placeholder="e.g. 32, 128",
                                           tooltip="prompt lengths to time prefill at, in tokens, comma-separated")
        self.threads = widgets.BoundedIntText(value=threads, min=1, max=256, description="threads")
        self.repeats = widgets.BoundedIntText(value=repeats, min=1, max=1000, description="repeats")
        self.run_button = widgets.Button(description="Profile", button_style="primary", icon="tachometer-alt")
        self.run_button.on_click(lambda _: self.run())
        self.table = widgets.HTML()
        self.skipped = widgets.HTML()  # what was not profiled and why: a grey note, not an error
        self.plot, self.bound_plot = widgets.Output(), widgets.Output()
        self.controls = [self.directory, self.prompt_lengths, self.threads, self.repeats, self.run_button]
        head = [widgets.HTML("<b>Profile</b> every exported or converted model in a folder: prefill latency, decode "
                             "speed, size, memory (this machine's CPU; an NPU's own numbers come from its SDK)")]
        if session is not None:
            head.append(self._own(SessionLabel(session)))
            self._watch(session, self._on_session_folder, ["quantized", "out_dir"])
        super().__init__([
            *head, self.directory, widgets.HBox([self.prompt_lengths, self.threads, self.repeats, self.run_button]),
            self.status_line, self.skipped, self.log_output, self.table, self.plot, self.bound_plot])

    def run(self) -> list[RuntimeProfile] | None:
        skipped: list[str] = []

        def on_model(i: int, n: int, name: str) -> None:  # the bar under the button, model by model
            self.status_line.count(i, n, "models")
            self.status_line.html.value = html.escape(f"profiling {name} ({i + 1} of {n})...")

        self.skipped.value = ""
        ok, result = self._attempt("profiling...", lambda: (profile_directory(
            self.directory.value.strip(), prompt_lengths=parse_prompt_lengths(self.prompt_lengths.value),
            threads=self.threads.value, repeats=self.repeats.value, log=skipped.append, on_model=on_model),
            host_bandwidth(self.workspace)))
        if skipped:
            self.skipped.value = ("<div style='font-size:12px;color:#5d6d7e'>not profiled: "
                                  + "; ".join(html.escape(line) for line in skipped) + "</div>")
        if not ok:
            return None
        profiles, self.host = result
        self.profiles = profiles
        if self.session is not None:
            with self.session.hold_trait_notifications():
                self.session.host = self.host
                self.session.profiles = list(profiles)
        gbps, cache = self.host["read_gbps"], last_level_cache_bytes()
        self.table.value = _rows(profiles, gbps, cache)
        self.status.value = html.escape(f"{len(profiles)} model(s) timed, median of {self.repeats.value} runs; memory "
                                        f"bound: this host's read bandwidth {gbps:.1f} GB/s / bytes one decode step "
                                        "reads")
        self._plot("profile", make_profile_figure(profiles), self.plot)
        self._plot("decode-bound", make_host_bound_figure(profiles, gbps, cache), self.bound_plot)
        return profiles

    def _on_session_folder(self, _change) -> None:
        """Follow Export: its conversions of the session's quantized model land in this folder."""
        self.directory.value = str(self.session.conversion_dir)
