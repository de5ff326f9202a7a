"""The routing function and the config tables, as pure functions."""

import json

import pytest
import torch
from torch import nn

from conv_patch.routing import tables as config_tables
from conv_patch.routing.select import Route, select_route, static_route
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import Target

GPU = Target("sm90", True)
NO_TABLE_GPU = Target("sm1000", True)


def spec_of(m):
    return ConvSpec.from_module(m)


def call(shape=(1, 8, 16, 16), dtype=torch.bfloat16, **kw):
    kw.setdefault("weight_dtype", dtype)
    return CallDesc(shape=shape, dtype=dtype, device_type="cuda", layout=kw.pop("layout", "nchw"), **kw)


CONV = spec_of(nn.Conv2d(8, 4, 3, padding=1))
CONVT = spec_of(nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1))


def test_kernel_routes():
    # sm90 has a table that sends this stride-1 bf16 conv to the TMA kernel;
    # an sm80 part (no table of its own, no TMA) runs the portable one.
    assert select_route(CONV, call(), GPU).route is Route.CONV2D_TMA
    assert select_route(CONV, call(), Target("sm80", True)).route is Route.CONV2D_IGEMM
    assert select_route(CONVT, call(), GPU).route is Route.CONV_TRANSPOSE2D_IGEMM
    assert static_route(CONV).route is Route.CONV2D_IGEMM
    assert select_route(CONV).route is Route.CONV2D_IGEMM  # module only


@pytest.mark.parametrize("module,reason", [
    (nn.Conv2d(8, 8, 3, groups=2), "groups=2"),
    (nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
])
def test_static_fallbacks(module, reason):
    d = select_route(spec_of(module), call(), GPU)
    assert d.route is Route.FALLBACK and d.reason == reason
    assert static_route(spec_of(module)).reason == reason


@pytest.mark.parametrize("desc,target,needle", [
    (call(needs_grad=True), GPU, "autograd"),
    (call(compiling=True), GPU, "torch.compile"),
    (call(dtype=torch.float64), GPU, "float64"),
    (call(weight_dtype=torch.float32), GPU, "dtypes differ"),
    (call(bias_dtype=torch.float16), GPU, "dtypes differ"),
    (call(same_device=False), GPU, "different devices"),
    (call(shape=(8, 16, 16)), GPU, None),  # unbatched 3-D input is taken
    (call(shape=(1, 1, 8, 16, 16)), GPU, "5-D"),
    (call(shape=(1, 7, 16, 16)), GPU, "7 channels"),
    (call(shape=(0, 8, 16, 16)), GPU, "empty"),
    (call(shape=(1, 8, 1, 1)), Target("sm90", True), None),
    (call(), Target("cpu", False, "input on cpu (x)"), "input on cpu"),
    (call(), Target("sm75", False, "GPU sm75 is older than sm80"), "sm75"),
])
def test_call_fallbacks(desc, target, needle):
    d = select_route(CONV, desc, target)
    if needle is None:
        assert d.is_kernel
    else:
        assert d.route is Route.FALLBACK and needle in d.reason, d.reason


def test_output_size_and_output_padding_rejected():
    small = spec_of(nn.Conv2d(8, 4, 5))
    assert "not positive" in select_route(small, call(shape=(1, 8, 3, 3)), GPU).reason
    assert "output_padding" in select_route(CONVT, call(output_padding=(2, 0)), GPU).reason
    assert select_route(CONVT, call(output_padding=(1, 1)), GPU).is_kernel


def test_label_names_route_or_reason():
    assert select_route(CONV, call(), GPU).label() == "conv2d_tma"
    assert select_route(CONV, call(), NO_TABLE_GPU).label() == "conv2d_igemm"
    assert select_route(CONV, call(needs_grad=True), GPU).label().startswith("fallback (autograd")


def test_architecture_without_table_uses_default():
    d = select_route(CONV, call(), NO_TABLE_GPU)
    assert d.is_kernel and d.table == "default" and d.config["BLOCK_M"] >= 16
    assert config_tables.has_table("default") and not config_tables.has_table("sm1000")


def test_lookup_tiers():
    table = {
        "conv2d": {
            "exact": {config_tables.shape_key(CONV, (1, 8, 16, 16), "nhwc", torch.bfloat16):
                      {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}},
            "buckets": [{"max_m": 1000, "min_m": 300, "config": {"BLOCK_M": 256, "BLOCK_N": 16, "BLOCK_K": 16}},
                        {"max_m": 100, "config": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}},
                        {"max_m": None, "dtypes": ["float32"], "config": {"BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 16}}],
            "any": {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32},
        }
    }
    t = config_tables.Table(config_tables.validate_table(table, "t"), "t")
    exact = select_route(CONV, call(layout="nhwc"), GPU, t)
    assert (exact.tier, exact.config["BLOCK_M"]) == ("exact", 32)
    small = select_route(CONV, call(shape=(1, 8, 8, 8)), GPU, t)  # 64 output pixels: below min_m
    assert (small.tier, small.config["BLOCK_M"]) == ("bucket", 16)
    mid = select_route(CONV, call(shape=(1, 8, 20, 20)), GPU, t)  # 400: inside (300, 1000]
    assert (mid.tier, mid.config["BLOCK_M"]) == ("bucket", 256)
    f32 = select_route(CONV, call(dtype=torch.float32), GPU, t)
    assert (f32.tier, f32.config["BLOCK_M"]) == ("bucket", 64)
    anyd = select_route(CONV, call(), GPU, t)
    assert (anyd.tier, anyd.config["BLOCK_M"]) == ("any", 128)
    # No conv_transpose2d section: falls through to default.json.
    dt = select_route(CONVT, call(shape=(1, 8, 64, 64)), GPU, t)
    default = config_tables.packaged_table("default").data["conv_transpose2d"]["any"]
    assert dt.is_kernel and dt.config is default


def test_shape_key_format():
    key = config_tables.shape_key(spec_of(nn.Conv2d(256, 128, 3, padding=1)), (1, 256, 1024, 1024),
                                  "nhwc", torch.bfloat16)
    assert key == "n1.c256.h1024.w1024.o128.k3x3.s1x1.p1x1.d1x1.nhwc.bfloat16"
    same = spec_of(nn.Conv2d(4, 4, 4, padding="same"))
    assert ".p1x1/b2x2." in config_tables.shape_key(same, (1, 4, 8, 8), "nchw", torch.float16)


@pytest.mark.parametrize("name", ["default", "interpreter"])
def test_packaged_tables_valid(name):
    table = config_tables.packaged_table(name)
    assert table.name == name
    for kind in config_tables.KINDS:
        assert "any" in table.data[kind]


@pytest.mark.parametrize("table,needle", [
    ([], "must be a JSON object"),
    ({"conv2d": {"any": {"BLOCK_M": 100, "BLOCK_N": 16, "BLOCK_K": 16}}}, "BLOCK_M must be a power of two"),
    ({"conv2d": {"any": {"BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 16}}}, ">= 16"),
    ({"conv2d": {"buckets": [{"max_m": "big", "config": {}}]}}, "max_m"),
    ({"conv2d": {"buckets": [{"max_m": 64, "min_m": 64, "config": {}}]}}, "min_m must be"),
    ({"conv2d": {"buckets": [{"min_m": -1, "config": {}}]}}, "min_m must be"),
    ({"conv2d": {"exact": {"k": {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 0}}}}, "num_warps"),
])
def test_bad_tables_rejected(table, needle):
    with pytest.raises(config_tables.TableError, match=needle):
        config_tables.validate_table(table, "t.json")


def test_user_table_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(config_tables.TableError, match="bad.json: not valid JSON"):
        config_tables.load_user_table(bad)
    with pytest.raises(config_tables.TableError, match="missing.json: cannot read"):
        config_tables.load_user_table(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"conv2d": {"any": {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16}}}))
    table = config_tables.load_user_table(good)
    assert table.name == str(good) and table.data["conv2d"]["any"]["BLOCK_M"] == 32


def test_one_registry_names_every_route():
    """Routing, the tables, the launch layer, the tuner and `convpatch info`
    read one registry (conv_patch/routes.py): every route is in it once,
    every table name validates, every kernel route has a launcher."""
    from conv_patch.routing import tables as config_tables, registry as routes
    from conv_patch.kernels import api as kernels
    assert {e.route for e in routes.REGISTRY} == set(Route)
    assert config_tables.ROUTES == routes.TABLE_NAMES and set(routes.ROUTE_INFO) == set(Route)
    for e in routes.REGISTRY:
        if e.launcher:
            assert callable(routes.launcher(kernels, e.route))
    for name in routes.TABLE_NAMES:
        cfg = {"route": name, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
        config_tables.validate_table({"conv2d": {"exact": {"k": cfg}}}, "t")
    labels = {c["route"] for c in routes.tuner_candidates(Target("sm90", True))}
    assert labels == {"igemm", "tma", "taps", "flat"}
    assert "tma" not in {c["route"] for c in routes.tuner_candidates(Target("sm80", True))}
