"""The run report: found from a workspace or a run folder, read from the run's own files, one offline page."""
import html
import json
import re
import shutil
from html.parser import HTMLParser

import pytest

from workbench.quantize.plan import QuantPlan
from workbench.devices.projection import project
from workbench.charts.report import RunNotFound, build_report, find_run, write_report
from workbench.files.workspace import file_sha256


class _Loads(HTMLParser):
    """Every src / href of the page's own elements (script bodies are not parsed as markup)."""

    def __init__(self):
        super().__init__()
        self.urls, self.tags = [], set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def external_loads(page: str) -> list[str]:
    parser = _Loads()
    parser.feed(page)
    return [u for u in parser.urls if u.split(":", 1)[0].lower() in ("http", "https") or u.startswith("//")]


@pytest.fixture(scope="module")
def run(demo_run):
    root, app = demo_run
    return root, app, build_report(root)


def test_a_workspace_names_its_newest_run(demo_run, tmp_path):
    root, app = demo_run
    assert find_run(root) == app.out_dir == find_run(app.out_dir)
    for path, words in ((tmp_path / "missing", "does not exist"), (tmp_path, "holds no workbench run")):
        with pytest.raises(RunNotFound, match=words):
            find_run(path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(RunNotFound, match="is a file"):
        find_run(tmp_path / "file.txt")


def test_gathered_from_the_runs_own_files(run):
    root, app, report = run
    s = app.session
    rec = report.record
    assert rec["run"] == str(app.out_dir)
    assert QuantPlan.from_dict(rec["plan"]) == s.plan
    [q] = rec["quantized"]
    assert q["path"] == str(s.quantized_path) and q["cost"]["kl_divergence"] == s.cost.kl_divergence
    assert q["cost"]["kl_divergence_stderr"] == s.cost.kl_divergence_stderr
    files = {f["file"]: f for f in q["files"]}
    assert files["model.safetensors"]["sha256"] == file_sha256(s.quantized_path / "model.safetensors")
    assert files["model.safetensors"]["hash_from"] == "manifest"
    [c] = rec["conversions"]
    assert c["target"] == "ort-int4" and c["kl_divergence"] == s.conversions[0].kl_divergence
    onnx = next(f for f in c["files"] if f["file"] == "prefill.onnx")
    assert onnx["sha256"] == file_sha256(s.conversions[0].out_dir / "prefill.onnx")
    assert [p["name"] for p in rec["profiles"]] == [p.name for p in s.profiles]
    assert rec["host_bandwidth"]["read_gbps"] == app.profile_panel.host["read_gbps"] > 0
    assert rec["versions"]["run"]["workbench"] and rec["versions"]["report"]["torch"]


def test_projections_are_the_projection_modules_own(run):
    root, app, report = run
    s = app.session
    label = next(label for label in report.projections if label.startswith("rtn-"))
    for p in report.projections[label]:
        direct = project(str(s.quantized_path), p.device, s.quantized.plan)
        assert p.to_dict() == {**direct.to_dict(), "model": p.model}
    assert {"uniform int8", label} <= set(report.projections)  # uniform int4 is the same plan as the quantized one


def test_one_page_with_every_chart_and_nothing_loaded_from_the_network(run):
    root, app, report = run
    page = report.html
    assert list(report.figures) == ["Precisions: size against damage", "Quantized model: weight error per layer",
                                    "Conversions against the simulation", "Profile on this host",
                                    "Host decode against its bound", "Plans on devices",
                                    "Vendor measurements and the fit", "Quality, size and projected speed"]
    assert page.count("Plotly.newPlot(") == len(report.figures) == page.count("class='workbench-figure'")
    assert page.count("plotly.js v") == 1  # the library once, inlined
    assert external_loads(page) == []
    for text in ("KL", "± ", "ort-int4", "Snapdragon 8 Gen 3", "read bandwidth", "sha256", "transformers",
                 "nearest vendor measurement", "qai-hub-models"):
        assert text in page
    # issue 55.10: words, not field names; sizes in one convention (units.format_bytes), not "1,234,567 bytes"
    assert "+RSS" not in page and "memory added (MB)" in page and "(borrowed)" not in page
    assert not re.search(r"\d{1,3}(,\d{3})+ bytes", page)
    assert (app.out_dir / "report.html").read_text(encoding="utf-8").count("Plotly.newPlot(") == len(report.figures)


def test_run_strings_are_escaped(demo_run, tmp_path):
    root, app = demo_run
    run = tmp_path / "run"
    shutil.copytree(app.out_dir, run, ignore=shutil.ignore_patterns("*.zip"))
    doc = json.loads((run / "report.json").read_text())
    evil = "</script><img src=x onerror=alert(1)>"
    doc["precision_evaluations"][0]["label"] = evil
    doc["model"]["name"] = evil
    (run / "report.json").write_text(json.dumps(doc))
    page = build_report(run).html
    parser = _Loads()
    parser.feed(page)
    assert evil not in page and "img" not in parser.tags  # no element made from the run's strings
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in page  # in the tables
    assert "<\\/script><img src=x onerror=alert(1)>" in page  # in a figure's JSON, which cannot close its script


def test_a_folder_of_command_line_outputs(demo_run, tmp_path):
    """Without the app's report.json: the quantized model and the conversion alone, and a profile.json."""
    root, app = demo_run
    s = app.session
    out = tmp_path / "out"
    shutil.copytree(s.quantized_path, out / "q")
    shutil.copytree(s.conversions[0].out_dir, out / "c")
    (out / "profile.json").write_text(json.dumps({"host_bandwidth": app.profile_panel.host, "profiles": [
        {**p.to_dict(), "decode_bound_tps": 1.0, "fraction_of_bound": 1.0} for p in s.profiles]}))
    report = build_report(out, devices=["rk3588"])
    assert report.record["app_report"] is None and report.record["model"]["path"] == str(s.lm.path)
    assert [q["name"] for q in report.record["quantized"]] == ["q"]
    assert "Host decode against its bound" in report.figures and "Precisions: size against damage" not in report.figures
    assert [p.device for p in report.projections["q"]] == ["RK3588"]
    single = build_report(out / "q")  # a quantized model's own folder is a run too
    assert [q["name"] for q in single.record["quantized"]] == ["q"] and single.record["conversions"] == []


def test_written_atomically_and_never_into_a_directory(demo_run, tmp_path):
    root, _ = demo_run
    with pytest.raises(Exception, match="is a directory"):
        write_report(root, tmp_path)
    out = tmp_path / "r.html"
    write_report(root, out, devices=["8gen3"])
    assert out.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]  # no temporary file left


def test_a_comparison_on_the_devices_is_its_own_table(tmp_path):
    """A folder bench/devices_gap.py (or the Export tab) wrote: the table and chart of devices_gap.json; the
    conversions it made for it are in that table, not again under Conversions."""
    from workbench.run.devices_gap import DevicesGap, absent_row, simulation_row
    work = tmp_path / "gap"
    (work / "ort-qdq").mkdir(parents=True)
    (work / "ort-qdq" / "conversion.json").write_text(json.dumps({"target": "ort-qdq", "kl_divergence": 0.5}))
    sim = simulation_row({"kl_divergence": 3.25e-4, "top1_agreement": 0.987, "tokens": 512}, 4.0, 2**28)
    bad = {**sim, "target": "mnn", "runtime": "MNN CPU", "gap": "prefill: KL <9.9e-01> > 1.5 x simulation"}
    et = {**sim, "target": "executorch", "runtime": "ExecuTorch runtime, XNNPACK CPU", "bytes": 3_800_000,
          "speed": {"runtime": "ExecuTorch (XNNPACK)", "prefill_tps": 5432.1, "decode_tps": 234.5}}
    DevicesGap("demo", QuantPlan.uniform("int8").to_dict(), "abcd1234", "snapdragon-8-gen-3", 512, 4,
               [sim, bad, et, absent_row("rknn", "rknn-toolkit2 is not installed: make rknn-env")], str(work),
               complete=True).save()
    report = build_report(work, devices=["8gen3"])
    assert report.record["conversions"] == [] and len(report.record["devices_gaps"]) == 1
    page = report.html
    section = page[page.index("<h2>On the devices</h2>"):page.index("<h2>Host profile</h2>")]
    assert section.count("<tr class='gap-row'>") == 4 and "3.25e-04" in section and "0.9870" in section
    assert "<th>prefill tok/s</th><th>decode tok/s</th>" in section  # the runtime's own speed beside size
    assert "<td>3.8</td><td>5,432</td><td>234</td>" in section
    assert "<span class='gap'>GAP</span> prefill: KL &lt;9.9e-01&gt;" in section and "make rknn-env" in section
    from workbench.run.devices_gap import GAP_RULE
    assert f"</table><p class='gap-rule'>{html.escape(GAP_RULE)}</p>" in section  # the threshold judged by
    assert "On the devices: plan abcd1234" in report.figures and external_loads(page) == []


def test_links_out_of_the_run_folder_are_listed_as_skipped_never_followed(demo_run, tmp_path):
    """A ``root -> /`` folder link and a file link to a file outside: neither walked nor hashed."""
    import sys
    root, app = demo_run
    s = app.session
    out, outside = tmp_path / "out", tmp_path / "outside"
    shutil.copytree(s.quantized_path, out / "q")
    shutil.copytree(s.conversions[0].out_dir, out / "c")
    outside.mkdir()
    (outside / "secret").write_text("not the run's")
    (out / "root").symlink_to("/")
    (out / "c" / "secret_link").symlink_to(outside / "secret")
    seen = []
    sys.addaudithook(lambda event, args: seen.append(str(args[0])) if event in ("open", "os.listdir", "os.scandir")
                     and args and isinstance(args[0], str) and seen is not None else None)
    report = build_report(out)
    watched, seen = list(seen), None
    rows = {f["file"]: f for c in report.record["conversions"] for f in c.get("files", [])}
    assert rows["secret_link"]["hash_from"] == "skipped" and rows["secret_link"]["bytes"] is None
    assert file_sha256(outside / "secret") not in json.dumps(report.record)
    assert not [p for p in watched if p.startswith(("/proc", "/etc", str(outside)))]


def test_the_report_says_what_kl_top1_nats_and_perplexity_mean():
    """Issue 55.10: the report's numbers come with a one-line meaning each."""
    from workbench.charts.report import _words_html
    from workbench.charts.style import METRIC_WORDS
    words = _words_html()
    assert all(k in METRIC_WORDS for k in ("KL", "nats", "top-1", "perplexity"))
    assert "nats/token: the unit of KL" in words and "only comparable on the same text" in words
