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
