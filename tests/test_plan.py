import json
import re

import pytest
import torch

from workbench.errors import PlanError
from workbench.model.load import LayerInfo
from workbench.quantize.plan import PRECISIONS, PlanRule, Precision, QuantPlan, get_precision, register_precision

NAMES = [
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj",
    "lm_head",
]


def test_exact_beats_pattern_beats_default():
    plan = (QuantPlan(default="int4")
            .with_override("*.q_proj", "int8")
            .with_override("model.layers.1.self_attn.q_proj", "fp16"))
    assert plan.precision_name_for("model.layers.0.self_attn.q_proj") == "int8"
    assert plan.precision_name_for("model.layers.1.self_attn.q_proj") == "fp16"
    assert plan.precision_name_for("model.layers.0.mlp.down_proj") == "int4"
    # an exact rule wins even when a pattern is added after it
    later = plan.with_override("model.layers.*", "int8")
    assert later.precision_name_for("model.layers.1.self_attn.q_proj") == "fp16"


def test_last_pattern_wins_and_regex_and_none():
    plan = QuantPlan(default="int8").with_override("*.mlp.*", "int4").with_override("re:.*layers\\.1\\..*", None)
    assert plan.precision_name_for("model.layers.0.mlp.down_proj") == "int4"
    assert plan.precision_name_for("model.layers.1.mlp.down_proj") is None
    assert plan.precision_for("model.layers.1.mlp.down_proj") is None


def test_uniform_keeps_embeddings_fp16():
    plan = QuantPlan.uniform("int4")
    resolved = plan.resolve(NAMES)
    assert resolved["model.embed_tokens"] == "fp16" and resolved["lm_head"] == "fp16"
    assert resolved["model.layers.0.mlp.down_proj"] == "int4"


def test_json_round_trip(tmp_path):
    plan = QuantPlan.uniform("int4", group_size=64, symmetric=False).with_override("*.v_proj", "int8")
    path = plan.save(tmp_path / "plan.json")
    again = QuantPlan.load(path)
    assert again == plan
    assert again.to_dict()["version"] == 1
    assert again.resolve(NAMES) == plan.resolve(NAMES)


def test_with_override_returns_new_plan():
    plan = QuantPlan(default="int8")
    other = plan.with_override("lm_head", "fp16")
    assert plan.rules == () and other.precision_name_for("lm_head") == "fp16"
    assert other.with_override("lm_head", "int4").rules[-1].precision == "int4"
    assert len(other.with_override("lm_head", "int4").rules) == 1


def test_validation_names_closest_layers():
    plan = QuantPlan(default="int8").with_override("model.layers.0.self_attn.q_prj", "fp16")
    with pytest.raises(PlanError, match="matches no layer.*model.layers.0.self_attn.q_proj"):
        plan.validate(NAMES)
    QuantPlan(default="int8").with_override("*.q_proj", "fp16").validate(NAMES)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"default": "int8"}', "no 'version'"),
    ('{"version": 1, "default": "int7"}', "unknown precision 'int7'"),
    ('{"version": 1, "defualt": "int8"}', "unknown plan field"),
    ('{"version": 1, "rules": [{"pattern": "x"}]}', "rules"),
    ('{"version": 1, "group_size": 0}', "group_size"),
    ('{"version": 99}', "newer"),
    ('{"version": 1, "rules": [{"pattern": "re:(", "precision": "int8"}]}', "invalid regular expression"),
])
def test_bad_plan_json(text, message):
    with pytest.raises(PlanError, match=message):
        QuantPlan.from_json(text)


@pytest.mark.parametrize("fields, message", [
    ({"symmetric": "false"}, "field 'symmetric' must be true or false, got \"false\""),
    ({"symmetric": 0}, "field 'symmetric' must be true or false, got 0"),
    ({"version": "one"}, "field 'version' must be an integer, got \"one\""),
    ({"version": True}, "field 'version' must be an integer, got true"),
    ({"version": 0}, "field 'version' must be 1 or more"),
    ({"group_size": "128"}, "field 'group_size' must be an integer or null"),
    ({"group_size": 64.0}, "field 'group_size' must be an integer or null"),
    ({"default": 4}, "field 'default' must be a precision name or null"),
    ({"method": ["awq"]}, "field 'method' must be a method name"),
    ({"rules": {"x": "int8"}}, "field 'rules' must be a list"),
    ({"rules": [{"pattern": 3, "precision": "int8"}]}, "'rules' item 0 field 'pattern' must be a string"),
    ({"rules": [{"pattern": "x", "precision": 8}]}, "'rules' item 0 field 'precision' must be a precision name"),
    ({"rules": ["lm_head"]}, "'rules' item 0 must be a"),
    ({"meta": "note"}, "field 'meta' must be an object"),
])
def test_every_plan_field_is_type_checked_and_named_with_the_file(tmp_path, fields, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "default": "int4", **fields}))
    with pytest.raises(PlanError) as e:
        QuantPlan.load(path)
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_plan_file_not_utf8_or_a_directory(tmp_path):
    (tmp_path / "p.json").write_bytes(b'{"version": 1, "default": "\xff"}')
    with pytest.raises(PlanError, match=r"p\.json' is not UTF-8"):
        QuantPlan.load(tmp_path / "p.json")
    with pytest.raises(PlanError, match="is a directory"):
        QuantPlan.load(tmp_path)


def test_missing_plan_file(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        QuantPlan.load(tmp_path / "nope.json")


def test_precision_bytes():
    int4, int8, fp16 = (get_precision(n) for n in ("int4", "int8", "fp16"))
    assert fp16.weight_bytes(256, 256) == 256 * 256 * 2
    # 4-bit codes + one fp16 scale per 128-group
    assert int4.weight_bytes(256, 256, 128) == 256 * 256 // 2 + 256 * 2 * 2
    assert int8.weight_bytes(256, 256, None) == 256 * 256 + 256 * 2
    # asymmetric adds packed zero points
    assert int4.weight_bytes(256, 256, 128, symmetric=False) == int4.weight_bytes(256, 256, 128) + 256 * 2 // 2


def test_registry_has_room_for_more():
    register_precision(Precision("int7", 7, False, "test"))
    try:
        assert QuantPlan(default="int7").precision_for("x").bits == 7
    finally:
        PRECISIONS.pop("int7")


def test_registry_holds_int2_to_int8_and_two_level_precisions():
    assert {"int2", "int3", "int4", "int5", "int6", "int8", "int4-lpbq", "int8-lpbq"} <= set(PRECISIONS)
    lpbq = get_precision("int4-lpbq")
    assert (lpbq.bits, lpbq.scale_bits, lpbq.two_level) == (4, 4, True) and not get_precision("int4").two_level
    # a plan names them like any other precision, and loads back
    plan = QuantPlan.uniform("int4-lpbq", group_size=32).with_override("*.down_proj", "int3")
    assert QuantPlan.from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="scale_bits must be 1..8 on an integer precision"):
        Precision("fp16-x", 16, True, scale_bits=4)


def test_two_level_bytes_count_packed_sub_scales_and_one_float16_per_channel():
    lpbq, int3, int6 = (get_precision(n) for n in ("int4-lpbq", "int3", "int6"))
    # 4-bit codes + 4-bit sub-scale per 32-group (8 groups a row) + one float16 per output channel
    assert lpbq.weight_bytes(256, 256, 32) == 256 * 256 // 2 + 256 * 8 * 4 // 8 + 256 * 2
    assert lpbq.weight_bytes(256, 256, 32) < get_precision("int4").weight_bytes(256, 256, 64)
    assert int3.weight_bytes(256, 256, 128) == 256 * 256 * 3 // 8 + 256 * 2 * 2
    assert int6.weight_bytes(10, 30, None, symmetric=False) == -(-300 * 6 // 8) + 10 * 2 + -(-10 * 6 // 8)


def test_k_layouts_with_minimums_count_llamacpp_block_bytes_in_any_plan():
    """int4-k / int5-k are Q4_K / Q5_K: 144 and 176 bytes per 256 weights whatever the plan's group size or
    symmetry (their groups and minimums are the layout's own), and an asymmetric plan may name them."""
    for name, block in (("int4-k", 144), ("int5-k", 176)):
        p = get_precision(name)
        assert p.minimums and p.layer_group_size(128) == 32 and p.misfit(576) and not p.misfit(1536)
        for gs, sym in ((128, True), (32, False), (None, True)):
            assert p.weight_bytes(4, 512, gs, symmetric=sym) == 4 * 2 * block
    plan = QuantPlan.uniform("int4", symmetric=False).with_override("*.down_proj", "int5-k")
    assert QuantPlan.from_json(plan.to_json()) == plan
    from workbench.quantize import layer_quantizer
    q = layer_quantizer(plan, "int5-k", (8, 512))
    assert q.scale_bits.mins and q.group_size == 32
    with pytest.raises(PlanError, match="two-level ones in super-blocks"):
        Precision("int4-m", 4, False, scale_bits=6, minimums=True)
    with pytest.raises(PlanError, match="minimums go on integer weights"):
        Precision("fp16-m", 16, True, minimums=True)


def test_float_minimum_layouts_count_llamacpp_block_bytes_in_any_plan():
    """int4-min / int5-min are Q4_1 / Q5_1: 20 and 24 bytes per 32 weights (a float16 scale and a float16
    minimum per block, no zero point) whatever the plan's group size or symmetry; their quantizer has
    float minimums and no full-range grid."""
    for name, block in (("int4-min", 20), ("int5-min", 24)):
        p = get_precision(name)
        assert p.minimums and not p.two_level and p.layer_group_size(128) == 32 and p.misfit(48)
        for gs, sym in ((128, True), (32, False), (None, True)):
            assert p.weight_bytes(4, 512, gs, symmetric=sym) == 4 * 16 * block
    from workbench.quantize import layer_quantizer
    q = layer_quantizer(QuantPlan.uniform("int4", group_size=32, full_range=True), "int5-min", (8, 512))
    assert q.minimums and not q.full_range and q.scale_bits is None and q.group_size == 32
    qw = q.quantize(torch.randn(8, 512))
    assert qw.float_minimums and qw.storage_bytes() == 8 * 16 * 24


def test_table_lists_layers_and_total():
    plan = QuantPlan.uniform("int4")
    layers = [LayerInfo("model.layers.0.mlp.down_proj", "linear", (256, 768)), LayerInfo("lm_head", "linear", (4096, 256))]
    table = plan.table(layers)
    assert "int4" in table and "fp16" in table and "total" in table
    assert f"{4096 * 256 * 2:,}" in table
    lines = table.splitlines()  # text_table: names left, numbers right, each column as wide as its widest cell
    assert len({len(line) for line in lines}) == 1 and lines[-1].startswith("total ")


def test_text_table_sizes_columns_to_their_cells():
    from workbench.units import text_table
    out = text_table([("name", "n"), ("a-much-longer-name", "1,024"), ("b", "7")], right={1}, rule="-")
    assert out.splitlines() == ["name                    n",
                                "-------------------------",
                                "a-much-longer-name  1,024",
                                "b                       7"]
    assert text_table([("x", "y"), ("long cell", "")]).splitlines() == ["x          y", "long cell"]  # no trailing space


def test_scale_search_round_trips_and_is_type_checked():
    plan = QuantPlan.uniform("int4", scale_search=True)
    assert QuantPlan.from_json(plan.to_json()) == plan and plan.to_dict()["scale_search"] is True
    with pytest.raises(PlanError, match="plan field 'scale_search' must be true or false"):
        QuantPlan.from_dict({**plan.to_dict(), "scale_search": "yes"})


def test_scale_search_is_on_for_new_plans_and_off_for_files_saved_without_it():
    from workbench.quantize.plan import DEFAULT_SCALE_SEARCH
    assert DEFAULT_SCALE_SEARCH is True and QuantPlan().scale_search and QuantPlan.uniform("int4").scale_search
    off = QuantPlan.uniform("int4", scale_search=False)
    assert QuantPlan.from_json(off.to_json()) == off
    # a plan with it off writes what every plan wrote before the field existed (same file, hash and cache keys) ...
    assert "scale_search" not in off.to_dict()
    # ... so a file without it, saved before or with it off, keeps meaning off
    old = {"version": 1, "default": "int4", "group_size": 128, "symmetric": True, "method": "rtn",
           "rules": [{"pattern": "lm_head", "precision": "fp16"}]}
    assert QuantPlan.from_dict(old).scale_search is False


def test_every_plan_field_has_a_json_type_check():
    """A field added to QuantPlan without a type check would let a string "false" read as true again."""
    import dataclasses

    from workbench.quantize.plan import _FIELD_TYPES
    assert {f.name for f in dataclasses.fields(QuantPlan)} == set(_FIELD_TYPES)


def test_a_rule_matching_no_layer_names_the_plan_file(tmp_path):
    p = QuantPlan(default="int8", rules=(PlanRule("no_such_layer", "int4"),)).save(tmp_path / "my-plan.json")
    plan = QuantPlan.load(p)
    with pytest.raises(PlanError, match=rf"plan file '{re.escape(str(p))}': rule 'no_such_layer' matches no layer"):
        plan.validate(["model.layers.0.mlp.down_proj"])
    assert plan == QuantPlan.from_json(p.read_text()) and "source_file" not in plan.to_dict()


def test_full_range_round_trips_is_symmetric_only_and_absent_means_off():
    plan = QuantPlan.uniform("int4", group_size=32, full_range=True)
    assert QuantPlan.from_json(plan.to_json()) == plan and plan.to_dict()["full_range"] is True
    assert "full_range" not in QuantPlan.uniform("int4").to_dict()
    assert plan.quantizer_settings["full_range"] is True
    with pytest.raises(PlanError, match="symmetric 16-level"):
        QuantPlan.uniform("int4", symmetric=False, full_range=True)
    with pytest.raises(PlanError, match="plan field 'full_range' must be true or false"):
        QuantPlan.from_dict({**plan.to_dict(), "full_range": 1})


def test_vision_recipes_per_runtime():
    from workbench.quantize.plan import vision_recipe, vision_recipe_for
    for target in ("qnn", "htp", "ort-qdq"):  # Qualcomm: vision encoder w8a16 (int8 weights), language model w4a16
        r = vision_recipe(target, "qwen2_5_vl")
        assert (r.vision, r.projector, r.language) == ("int8", "int8", "int4")
    for model_type, bits in (("qwen2_vl", "int4"), ("qwen2_5_vl", "int4"), ("qwen3_vl", "int4"), ("smolvlm", "int8"),
                             ("idefics3", "int8")):  # MNN's visual.mnn: int4 block 128 for Qwen-VL, int8 otherwise
        r = vision_recipe("mnn", model_type)
        assert (r.vision, r.projector, r.language) == (bits, bits, None)
        assert vision_recipe("mnn-llm", model_type).vision == bits
    assert vision_recipe("llama.cpp", "qwen2_5_vl").vision == "fp16"  # mmproj f16 by default
    assert vision_recipe("llama.cpp", "qwen2_5_vl", mmproj="q8_0").projector == "int8"
    with pytest.raises(PlanError, match="no vision-language recipe for target 'rknn'"):
        vision_recipe("rknn")
    with pytest.raises(PlanError, match="mmproj type"):
        vision_recipe("llama.cpp", mmproj="q4_0")
    assert vision_recipe_for(None) is None and vision_recipe_for(["rknn", "tensorrt"]) is None
    assert vision_recipe_for(["rknn", "qnn"], "smolvlm").vision == "int8"
    assert vision_recipe_for("mnn", "smolvlm").vision == "int8"
    assert vision_recipe_for(["qnn", "mnn"], "smolvlm").vision == "int8"  # both int8 for SmolVLM: one recipe
    with pytest.raises(PlanError, match="differently"):
        vision_recipe_for(["qnn", "mnn"], "qwen2_5_vl")
