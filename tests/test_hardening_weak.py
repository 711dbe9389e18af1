"""What a user meets that is not a crash but misleads: each says so in one sentence, or is refused in one line
(exit 2). A user's device profile that replaces a bundled one, a context or prompt a projection cannot hold, bad or
ignored conversion options, an HTP refusal that names its cause, the RKNN toolkit's python and results, full disks
and file-size limits, and external data that leaves a graph's folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *argv) -> tuple[int, list[str], list[str]]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, [ln for ln in out.splitlines() if ln.strip()], [ln for ln in err.splitlines() if ln.strip()]


def _one_error(capsys, *argv) -> str:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and len(err) == 1 and ": error: " in err[0], (rc, out, err)
    assert "internal error" not in err[0] and "expected one argument" not in err[0]
    return err[0]


# -- a user's device profile replacing a bundled one -------------------------------------------------------------

@pytest.fixture
def fast_rk3588(tmp_path, monkeypatch):
    """A user's rk3588.json with 1000x the bundled bandwidth, in $WORKBENCH_DEVICES."""
    import workbench.devices.profiles as profiles
    doc = json.loads((profiles.DEVICES_DIR / "rk3588.json").read_text())
    doc["memory_bandwidth_gbps"]["value"] *= 1000
    (tmp_path / "rk3588.json").write_text(json.dumps(doc))
    monkeypatch.setenv(profiles.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(profiles, "_said", set())
    return tmp_path / "rk3588.json"


def test_a_user_profile_replacing_a_bundled_one_is_said_when_used(fast_rk3588, capsys):
    from workbench.devices.profiles import DEVICES_DIR
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "rk3588", "--bits", "8")
    assert rc == 0
    notes = [ln for ln in err if "replaces" in ln]
    assert len(notes) == 1, err
    assert str(fast_rk3588) in notes[0] and str(DEVICES_DIR / "rk3588.json") in notes[0]
    assert "memory_bandwidth_gbps 34000 (was 34)" in notes[0], notes[0]
    rc, out, err = _run(capsys, "devices")
    assert rc == 0 and [ln for ln in out if ln.startswith("note: device 'rk3588'") and "replaces" in ln], out


def test_a_bundled_profile_used_as_it_is_says_nothing(capsys, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEVICES", raising=False)
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "rk3588", "--bits", "8")
    assert rc == 0 and not [ln for ln in err + out if "replaces" in ln]


# -- projections past what a context holds ------------------------------------------------------------------------

def test_a_huge_context_is_projected_at_the_bound_never_above_it():
    from workbench.devices.projection import project
    p = project("qwen2.5-1.5b", "8gen3", context=10**12, runtime="auto")
    assert p.decode_bound_tps < 1e-3
    assert p.projected_decode_tps <= p.decode_bound_tps and p.efficiency <= 1.0
    assert any("above the bandwidth bound" in n and "1,000,000,000,000-token context" in n for n in p.notes), p.notes
    short = project("qwen2.5-1.5b", "8gen3", context=1024, runtime="auto")
    assert short.projected_decode_tps < short.decode_bound_tps
    assert not any("above the bandwidth bound" in n for n in short.notes)


def test_the_projection_table_never_prints_a_zero_bound(capsys):
    rc, out, err = _run(capsys, "project", "qwen2.5-1.5b", "--device", "8gen3", "--bits", "4",
                        "--context", "1000000000000")
    decode = next(ln for ln in out if ln.strip().startswith("decode "))
    assert rc == 0 and "0.0 tok/s" not in decode and "e-06 tok/s" in decode, decode
    eff = next(ln for ln in out if ln.strip().startswith("efficiency"))
    assert "1.00 of the bound" in eff, eff


def test_a_prompt_longer_than_the_context_is_noted():
    from workbench.devices.projection import project
    p = project("qwen2.5-1.5b", "8gen3", context=100, prompt=500, runtime=None)
    assert any("500-token prompt is longer than the 100-token context" in n for n in p.notes), p.notes
    assert not any("prompt is longer" in n for n in project("qwen2.5-1.5b", "8gen3", context=500, prompt=500,
                                                              runtime=None).notes)


# -- conversion options: their values in the user's terms, and said when a target ignores them -------------------

@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("value", ["-1,5", "1,1", "0,5", "4,0", "-3,-3"])
def test_a_static_shape_out_of_range_is_refused_in_the_options_terms(command, value, capsys, tmp_path):
    extra = ["--bits", "4", "--target", "qnn"] if command == "convert" else []
    line = _one_error(capsys, command, "demo", *extra, "--static", value, "--out", tmp_path / "out")
    assert f"--static {value}: SEQ" in line and "at least 2" in line and "PAST" in line, line
    assert "ctx" not in line, line  # no name the user never gave
    assert not (tmp_path / "out").exists()


def test_a_negative_value_reaches_its_options_own_check(capsys):
    """argparse alone takes ``-5`` after an option for an unknown flag ("expected one argument")."""
    with pytest.raises(SystemExit) as stop:
        main(["project", "demo", "--device", "8gen3", "--ram-gb", "-5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --ram-gb: must be a finite number > 0, got -5" in err, err
    assert "expected one argument" not in err


def test_options_a_target_does_not_read_are_named():
    from workbench.targets.convert import ignored_options
    from workbench.targets.registry import get_target
    notes = ignored_options(get_target("ort-int4"), static=(64, 128), soc="8gen3")
    assert notes == ["--static is ignored by ort-int4: it is read by ort-qdq, qnn, rknn only",
                     "--soc is ignored by ort-int4: it is read by qnn only"], notes
    assert ignored_options(get_target("qnn"), static=(64, 128), soc="8gen3") == []
    assert ignored_options(get_target("rknn"), static=(64, 128), soc=None) == []
    assert ignored_options(get_target("ort-int4"), static=None, soc=None) == []


def test_convert_says_which_options_ort_int4_ignored(capsys, tmp_path):
    rc, out, err = _run(capsys, "convert", "demo", "--bits", "4", "--target", "ort-int4", "--static", "64,128",
                        "--soc", "8gen3", "--out", tmp_path / "o", "--max-tokens", "64")
    assert rc == 0, err
    assert "note: --static is ignored by ort-int4: it is read by ort-qdq, qnn, rknn only" in out, out
    assert "note: --soc is ignored by ort-int4: it is read by qnn only" in out, out
    record = json.loads((tmp_path / "o" / "conversion.json").read_text())
    assert any("--soc is ignored" in n for n in record["notes"])
