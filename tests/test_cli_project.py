import json

from workbench.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_project_json_from_a_shape_name(capsys):
    out = run_json(capsys, "project", "qwen2.5-1.5b", "--device", "8gen3", "--bits", "8", "--embeddings", "int8",
                   "--context", "2048", "--claim-decode", "13.5", "--json")
    assert out["device"] == "Snapdragon 8 Gen 3" and out["context"] == 2048
    assert out["kv_bytes"] == 2048 * out["kv_bytes_per_token"]
    assert 0 < out["projected_decode_tps"] < out["decode_bound_tps"]
    assert out["claims"][0]["possible"] is True
    assert out["fits_ram"] is None  # a phone SoC's profile does not know the phone's RAM
    out = run_json(capsys, "project", "qwen2.5-1.5b", "--device", "8gen3", "--bits", "16", "--ram-gb", "2", "--json")
    assert out["ram_bytes"] == 2_000_000_000 and out["fits_ram"] is False


def test_project_table_flags_an_impossible_claim(capsys):
    assert main(["project", "qwen3-1.7b", "--device", "rk3588", "--bits", "8", "--embeddings", "int8",
                 "--claim-decode", "22", "--claim-peak-gb", "1.7"]) == 0
    text = capsys.readouterr().out
    assert "claim decode 22: IMPOSSIBLE" in text and "claim peak memory 1.7: IMPOSSIBLE" in text


def test_project_reads_a_plan_and_a_model_directory(capsys, tiny_model_dir, tmp_path):
    from workbench.quantize.plan import QuantPlan
    plan = tmp_path / "plan.json"
    QuantPlan.uniform("int4").with_override("*.v_proj", "int8").save(plan)
    out = run_json(capsys, "project", str(tiny_model_dir), "--device", "jetson-nano", "--plan", str(plan), "--json")
    bad = {q for _, q in out["unsupported_layers"]}
    assert bad == {"int4", "int8"}


def test_project_unknown_device_is_one_line(capsys):
    assert main(["project", "qwen2.5-0.5b", "--device", "pixel-99"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown device 'pixel-99'" in err[0]


def test_devices_lists_profiles_with_sources(capsys, tmp_path, monkeypatch):
    src = json.loads(open("assets/devices/rk3588.json").read())
    src["name"] = "My Board"
    (tmp_path / "my-board.json").write_text(json.dumps(src))
    monkeypatch.setenv("WORKBENCH_DEVICES", str(tmp_path))
    out = run_json(capsys, "devices", "--json")
    keys = {d["key"] for d in out}
    assert {"my-board", "snapdragon-8-elite", "jetson-nano"} <= keys
    nano = next(d for d in out if d["key"] == "jetson-nano")
    assert nano["npu_int8_tops"]["value"] is None and "reason" in nano["npu_int8_tops"]
    assert main(["devices", "--sources"]) == 0
    assert "memory_bandwidth_gbps: 'Jetson TX2 GPU" in capsys.readouterr().out


def test_devices_refuses_a_bad_user_file_in_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "broken.json").write_text(json.dumps({"name": "x", "device_class": "y", "accelerator": "z"}))
    monkeypatch.setenv("WORKBENCH_DEVICES", str(tmp_path))
    assert main(["devices"]) == 2
    err = capsys.readouterr().err
    assert "broken.json': field 'memory_bandwidth_gbps' is missing" in err


def test_project_a_quantized_directory_uses_its_own_plan(capsys, lm, tmp_path):
    from workbench.quantize.plan import QuantPlan
    from workbench.quantize import quantize_model
    plan = QuantPlan.uniform("int4").with_override("*.down_proj", "int8")
    qm = quantize_model(lm, plan)
    out_dir = qm.save(tmp_path / "q")
    out = run_json(capsys, "project", str(out_dir), "--device", "rk3588", "--json")
    assert out["bits_per_weight"] == qm.bits_per_weight  # the quantized model's own figure
    assert out["weight_bytes"] == lm.size_bytes(plan)
