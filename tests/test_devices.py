import json

import pytest

from workbench.devices.profiles import LIST_FIELDS, NUMBER_FIELDS, DeviceError, get_device, load_device, load_devices

REQUIRED = ("Snapdragon 8 Gen 2", "Snapdragon 8 Gen 3", "Snapdragon 8 Elite", "Snapdragon X Elite", "RK3588",
            "Jetson Orin Nano 8GB", "Jetson Nano 4GB", "Kirin 9000")


def _profile(**over) -> dict:
    d = {"name": "Toy Board", "device_class": "toy", "accelerator": "a toy NPU", "aliases": ["toy"],
         **{f: {"value": 1.5, "source": "toy datasheet p. 3"} for f in NUMBER_FIELDS},
         **{f: {"value": ["int8"], "source": "toy datasheet p. 4"} for f in LIST_FIELDS}}
    d.update(over)
    return d


def test_bundled_profiles_cover_the_field_and_every_figure_is_sourced():
    devices = load_devices()
    assert {d.name for d in devices.values()} >= set(REQUIRED)
    for d in devices.values():
        for f in (*NUMBER_FIELDS, *LIST_FIELDS):
            s = d.sources[f]
            assert ("source" in s) != ("reason" in s)
            assert (getattr(d, f) is None) == ("reason" in s), (d.key, f)
    assert get_device("8gen3").npu_int8_tops == 45.0
    assert get_device("Jetson Nano 4GB").npu_int8_tops is None  # Maxwell: no fast INT8, said why
    assert "Int8 support: 0" in get_device("jetson-nano").source("npu_int8_tops")


def test_a_user_adds_a_device_as_one_file(tmp_path, monkeypatch):
    (tmp_path / "toy-board.json").write_text(json.dumps(_profile()))
    devices = load_devices([tmp_path])
    assert list(devices) == ["toy-board"]
    assert get_device("TOY", devices).memory_bandwidth_gbps == 1.5
    monkeypatch.setenv("WORKBENCH_DEVICES", str(tmp_path))
    everything = load_devices()
    assert "toy-board" in everything and "rk3588" in everything


@pytest.mark.parametrize("field", [*NUMBER_FIELDS, *LIST_FIELDS, "name", "device_class"])
def test_a_missing_field_is_refused_naming_file_and_field(tmp_path, field):
    d = _profile()
    del d[field]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(DeviceError, match=rf"'{path}'.*field '{field}' .*missing"):
        load_device(path)


@pytest.mark.parametrize("field", list(NUMBER_FIELDS))
def test_a_negative_figure_is_refused(tmp_path, field):
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(_profile(**{field: {"value": -3, "source": "x"}})))
    with pytest.raises(DeviceError, match=rf"neg.json'.*field '{field}' is negative"):
        load_devices([tmp_path])


@pytest.mark.parametrize("entry, message", [
    ({"value": 3}, "no 'source'"),
    ({"value": None}, "null without a 'reason'"),
    ({"value": "fast", "source": "x"}, "must be a number"),
    ({"value": float("nan"), "source": "x"}, "is nan, not a figure"),
    ({"value": float("inf"), "source": "x"}, "is inf, not a figure"),
    (7, "must be an object"),
])
def test_unsourced_or_malformed_figures_are_refused(tmp_path, entry, message):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(_profile(memory_bandwidth_gbps=entry)))
    with pytest.raises(DeviceError, match=message):
        load_device(path)


def test_unknown_device_names_the_choices():
    with pytest.raises(DeviceError, match="unknown device 'pixel-99'; choose one of: .*rk3588"):
        get_device("pixel-99")


def test_the_devices_table_lines_up_however_long_a_name(tmp_path, monkeypatch, capsys):
    """`workbench devices`: every column as wide as its widest cell, so a long key or name shifts none."""
    from workbench.cli import main
    long = _profile(name="A Very Long Development Board Name With Its Revision",
                    device_class="a-long-accelerator-class", ram_gb={"value": 123456.25, "source": "x"})
    (tmp_path / "a-board-whose-file-name-is-longer-than-any-bundled-one.json").write_text(json.dumps(long))
    monkeypatch.setenv("WORKBENCH_DEVICES", str(tmp_path))
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rule, rows = lines[0], lines[1], lines[2:-1]
    devices = load_devices()
    assert set(rule) == {"-"} and len(rows) == len(devices)
    left = {"device": lambda d: d.key, "name": lambda d: d.name, "class": lambda d: d.device_class,
            "weights": lambda d: ",".join(d.weight_precisions)}
    right = {"GB/s": "memory_bandwidth_gbps", "INT8 TOPS": "npu_int8_tops", "FP16 TOPS": "npu_fp16_tops",
             "RAM GB": "ram_gb", "NPU limit GB": "npu_memory_limit_gb"}
    for line, d in zip(rows, devices.values()):
        for title, cell in left.items():  # a text column starts where its title does, whole
            at = header.index(title)
            assert line[at:at + len(cell(d))] == cell(d) and (at == 0 or line[at - 1] == " "), (title, line)
        for title, field in right.items():  # a number column ends where its title does
            end = header.index(title) + len(title)
            v = getattr(d, field)
            cell = "-" if v is None else f"{v:g}"
            assert line[end - len(cell):end] == cell and line[end - len(cell) - 1] == " " and line[end] == " ", \
                (title, line)
    assert max(len(x) for x in rows) == len(rule) and "123456" in rows[-1]  # the user's folder comes last
