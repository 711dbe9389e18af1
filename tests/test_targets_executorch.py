"""executorch: the plan's model as an XNNPACK .pte holding the plan's codes, run, scored, streamed and timed by
ExecuTorch's runtime."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

try:
    import executorch.runtime  # noqa: F401
    import torchao  # noqa: F401  (ExecuTorch's XNNPACK backend imports it)
except ImportError:
    pytest.skip("ExecuTorch is not installed: pip install --no-deps executorch==1.5.1 torchao==0.18.0 "
                "ruamel.yaml==0.19.1 tabulate==0.10.0 (or make install)", allow_module_level=True)

from workbench.cli import main
from workbench.targets.convert import convert, prepare_models
from workbench.errors import ModelLoadError, PlanError, WorkbenchError
from workbench.quantize.plan import QuantPlan
from workbench.run.locate import locate, open_runner
from workbench.targets.executorch import FILES, PTE_FILE, EtDecoder, ExecuTorchLM, check_pte_codes, pte_weights

pytestmark = pytest.mark.slow
EVAL = {"max_tokens": 2048}  # the demo text's first 2,048 tokens: four 512-token windows


@pytest.fixture(scope="module")
def bits4(tmp_path_factory):
    """`workbench convert demo --bits 4 --target executorch` (int4, groups of 128, scale search on)."""
    out = tmp_path_factory.mktemp("executorch")
    prep = prepare_models("demo", bits=4)
    return convert("demo", "executorch", out, prepared=prep, **EVAL), out, prep


def test_convert_writes_the_program_and_scores_it_in_executorch(bits4):
    report, out, _ = bits4
    assert all((out / f).is_file() and (out / f).stat().st_size > 0 for f in FILES + ("tokenizer.json",))
    assert json.loads((out / "conversion.json").read_text())["target"] == "executorch"
    info = report.details["executorch"]
    assert info["quantized_linear_layers"] == 28 and info["plan_layers_checked"] == 28
    sim = report.simulation["kl_divergence"]
    assert report.kl_divergence <= 1.5 * sim, (report.kl_divergence, sim)
    assert report.gap is None
    d = report.decode  # teacher-forced through the program's own KV cache, every step scored
    assert d["tokens"] >= 512 and d["kl_divergence"] <= 1.5 * sim, (d["kl_divergence"], sim)
    speed = report.details["runtime_speed"]
    assert speed["runtime"].startswith("ExecuTorch") and speed["decode_tokens_per_second"] > 0


def _unpack4(buf: bytes, rows: int, cols: int) -> np.ndarray:
    """XNNPACK's 4-bit weight buffer back to signed codes: two a byte, low nibble first, offset by 8."""
    b = np.frombuffer(buf, np.uint8)
    return np.stack([b & 15, b >> 4], -1).reshape(rows, cols).astype(np.int16) - 8


def test_the_program_holds_the_plan_integers(bits4):
    """Every quantized layer's codes are one of the .pte's constant buffers, read back from the file."""
    _, out, prep = bits4
    buffers = [b for b in pte_weights(out / PTE_FILE).values()]
    for name, qw in prep.qm.weights.items():
        rows, cols = qw.shape
        want = qw.qweight.to(torch.int16).numpy()
        same = [b for b in buffers if len(b) == rows * cols // 2 and np.array_equal(_unpack4(b, rows, cols), want)]
        assert same, f"{name}: the plan's codes are not in the program"
        scales = qw.scales.float().to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        assert scales in buffers, f"{name}: its scales (as bfloat16) are not in the program"
    assert check_pte_codes(out / PTE_FILE, prep.qm) == len(prep.qm.weights)


def test_a_changed_code_is_caught(bits4):
    _, out, prep = bits4
    name, qw = next(iter(prep.qm.weights.items()))
    old = int(qw.qweight[0, 0])
    qw.qweight[0, 0] = old + 1 if old < 7 else old - 1
    try:
        with pytest.raises(WorkbenchError, match=name):
            check_pte_codes(out / PTE_FILE, prep.qm)
    finally:
        qw.qweight[0, 0] = old


def test_decode_through_the_program_cache_matches_a_whole_prompt(bits4):
    _, out, prep = bits4
    lm = ExecuTorchLM(out)
    ids = list(range(5, 45))
    whole = lm.logits(np.array([ids]))[0]
    lm.run_prefill(ids[:20])
    steps = [lm.run_decode(t, None, p)[0] for p, t in enumerate(ids[20:], start=20)]
    np.testing.assert_allclose(np.stack(steps), whole[20:], atol=1e-4)
    with torch.no_grad():  # the exported module, run eagerly, computes the program's arithmetic
        eager = EtDecoder(prep.sim_lm.model, lm.max_length)(torch.tensor([ids]), torch.arange(len(ids)))[0].numpy()
    # the program's int8 dynamic activations move logits by up to 0.7% of their range on the demo model (0.10 of
    # 14.7); argmax agreement would test near-ties of arbitrary token ids, not the arithmetic
    assert np.abs(eager - whole).max() < 0.02 * np.abs(eager).max()
    with pytest.raises(WorkbenchError, match=f"holds {lm.max_length} positions"):
        lm.logits(np.arange(1, lm.max_length + 2)[None])


def test_generate_streams_through_executorch(bits4, capsys):
    _, out, _ = bits4
    assert main(["generate", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runtime"].startswith("ExecuTorch") and doc["new_tokens"] == 8


def test_profile_prints_executorch_own_speed(bits4, capsys):
    _, out, _ = bits4
    assert locate(out).target.name == "executorch"
    assert main(["profile", str(out), "--repeats", "1"]) == 0
    assert "ExecuTorch" in capsys.readouterr().out
    lm = open_runner(out)
    assert lm.prefill_seconds(list(range(1, 33))) > 0 and lm.decode_seconds(list(range(1, 33)), 4) > 0


def test_a_folder_without_the_program_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=PTE_FILE):
        ExecuTorchLM(tmp_path)


@pytest.mark.parametrize("plan, layout", [
    (QuantPlan.uniform("int8", group_size=128), "8-bit per-128"),
    (QuantPlan.uniform("int4", group_size=128, symmetric=False), "4-bit per-128 asymmetric"),
    (QuantPlan.uniform("int4", group_size=16), "4-bit per-16"),
])
def test_layouts_xnnpack_cannot_hold_are_refused_by_layer(plan, layout, tmp_path):
    prep = prepare_models("demo", plan=plan)
    with pytest.raises(PlanError, match=f"layer 'model.layers.0.self_attn.q_proj' as {layout}"):
        convert("demo", "executorch", tmp_path, prepared=prep, evaluate_outputs=False)
    assert not (tmp_path / PTE_FILE).exists()


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_per_channel_plans_keep_their_codes_and_run_like_the_simulation(precision, tmp_path):
    prep = prepare_models("demo", plan=QuantPlan.uniform(precision, group_size=None))
    report = convert("demo", "executorch", tmp_path, prepared=prep, evaluate_outputs=False)
    assert report.details["executorch"]["plan_layers_checked"] == len(prep.qm.weights) == 28
    buffers = list(pte_weights(tmp_path / PTE_FILE).values())
    for name, qw in prep.qm.weights.items():  # the codes as they are, one float32 scale per output channel
        rows, cols = qw.shape
        if precision == "int8":
            assert qw.qweight.to(torch.int8).numpy().tobytes() in buffers, name
        else:
            want = qw.qweight.to(torch.int16).numpy()
            assert any(len(b) == rows * cols // 2 and np.array_equal(_unpack4(b, rows, cols), want)
                       for b in buffers), name
        assert qw.scales.float()[:, 0].numpy().tobytes() in buffers, name
    ids = torch.arange(10, 110)[None]
    with torch.no_grad():
        sim = prep.sim_lm.model(ids).logits[0].float().numpy()
    got = ExecuTorchLM(tmp_path).logits(ids.numpy())[0]
    assert np.mean(np.argmax(got, -1) == np.argmax(sim, -1)) >= 0.95
