"""The routing function and the config tables, as pure functions."""

import json

import pytest
import torch
from torch import nn

from conv_patch.routing import tables as config_tables
from conv_patch.routing.registry import Route
from conv_patch.routing.decide import decide, static_route
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
    assert decide(CONV, call(), GPU, as_called=False).route is Route.CONV2D_TMA
    assert decide(CONV, call(), Target("sm80", True), as_called=False).route is Route.CONV2D_IGEMM
    assert decide(CONVT, call(), GPU, as_called=False).route is Route.CONV_TRANSPOSE2D_IGEMM
    assert static_route(CONV).route is Route.CONV2D_IGEMM
    assert decide(CONV, as_called=False).route is Route.CONV2D_IGEMM  # module only


@pytest.mark.parametrize("module,reason", [
    (nn.Conv2d(8, 8, 3, groups=2), "groups=2"),
    (nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
])
def test_static_fallbacks(module, reason):
    d = decide(spec_of(module), call(), GPU, as_called=False)
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
    d = decide(CONV, desc, target, as_called=False)
    if needle is None:
        assert d.is_kernel
    else:
        assert d.route is Route.FALLBACK and needle in d.reason, d.reason


def test_output_size_and_output_padding_rejected():
    small = spec_of(nn.Conv2d(8, 4, 5))
    assert "not positive" in decide(small, call(shape=(1, 8, 3, 3)), GPU, as_called=False).reason
    assert "output_padding" in decide(CONVT, call(output_padding=(2, 0)), GPU, as_called=False).reason
    assert decide(CONVT, call(output_padding=(1, 1)), GPU, as_called=False).is_kernel


def test_label_names_route_or_reason():
    assert decide(CONV, call(), GPU, as_called=False).label() == "conv2d_tma"
    assert decide(CONV, call(), NO_TABLE_GPU, as_called=False).label() == "conv2d_igemm"
    assert decide(CONV, call(needs_grad=True), GPU, as_called=False).label().startswith("fallback (autograd")


def test_architecture_without_table_uses_default():
    d = decide(CONV, call(), NO_TABLE_GPU, as_called=False)
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
    exact = decide(CONV, call(layout="nhwc"), GPU, t, as_called=False)
    assert (exact.tier, exact.config["BLOCK_M"]) == ("exact", 32)
    small = decide(CONV, call(shape=(1, 8, 8, 8)), GPU, t, as_called=False)  # 64 output pixels: below min_m
    assert (small.tier, small.config["BLOCK_M"]) == ("bucket", 16)
    mid = decide(CONV, call(shape=(1, 8, 20, 20)), GPU, t, as_called=False)  # 400: inside (300, 1000]
    assert (mid.tier, mid.config["BLOCK_M"]) == ("bucket", 256)
    f32 = decide(CONV, call(dtype=torch.float32), GPU, t, as_called=False)
    assert (f32.tier, f32.config["BLOCK_M"]) == ("bucket", 64)
    anyd = decide(CONV, call(), GPU, t, as_called=False)
    assert (anyd.tier, anyd.config["BLOCK_M"]) == ("any", 128)
    # No conv_transpose2d section: falls through to default.json.
    dt = decide(CONVT, call(shape=(1, 8, 64, 64)), GPU, t, as_called=False)
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
    """The decision, the tables, the ops that launch a route, the tuner and
    `convpatch info` read one registry (conv_patch/routing/registry.py), for
    2-D and 3-D alike: every route is in it once, every table name
    validates, every kernel route has a launcher and its kind's candidates."""
    from conv_patch.routing import registry, tables
    assert {e.route for e in registry.REGISTRY} == set(Route)
    assert tables.ROUTES == registry.TABLE_NAMES and set(registry.ROUTE_INFO) == set(Route)
    for e in registry.REGISTRY:
        if e.is_kernel:
            assert callable(registry.launcher_of(e.route)) and e.kind in ("conv2d", "conv_transpose2d", "conv3d")
    for name in registry.TABLE_NAMES:
        cfg = {"route": name, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
        tables.validate_table({"conv2d": {"exact": {"k": cfg}}}, "t")
    assert set(registry.table_names("conv3d")) == {"igemm", "tma", "cudnn"}
    labels = {c["route"] for c in registry.tuner_candidates(Target("sm90", True))}
    assert labels == {"igemm", "tma", "tma_padded", "taps", "flat", "im2col"}
    assert not {"tma", "tma_padded", "im2col"} & {c["route"] for c in registry.tuner_candidates(Target("sm80", True))}
    assert {c["route"] for c in registry.tuner_candidates(Target("sm90", True), "conv3d")} == {"igemm", "tma"}
    assert {c["route"] for c in registry.tuner_candidates(Target("interpreter", True, interpreter=True),
                                                          "conv3d")} == {"igemm", "tma"}


def test_route_names_are_spelled_only_in_the_registry():
    """Outside conv_patch/routing/registry.py no code of the package spells
    a route's name or a table's route value as a literal: each caller asks
    the registry (a literal elsewhere is a second copy that can drift)."""
    import ast
    from pathlib import Path

    from conv_patch.routing import registry
    root = Path(__file__).resolve().parents[1]
    names = {r.value for r in Route} | set(registry.TABLE_NAMES)
    found = []
    for path in sorted([*root.glob("conv_patch/**/*.py"), *root.glob("kernels/*.py"), *root.glob("recipes/*.py")]):
        if path.name == "registry.py" and path.parent.name == "routing":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_a_misaligned_output_or_residual_is_not_aligned16():
    """A caller's ``out`` or residual may be a view into a larger buffer
    (the ESRGAN dense block writes each conv into a channel slice): the TMA
    routes, whose descriptors need 16-byte aligned bases, must see it."""
    from conv_patch.specs import CallDesc
    x, w = torch.randn(1, 8, 4, 4), torch.randn(8, 8, 3, 3)
    buf = torch.empty(1, 17, 3, 3)  # channel 1 starts 36 bytes in
    assert CallDesc.of_call(x, w, out=buf[:, :8]).aligned16
    assert not CallDesc.of_call(x, w, out=buf[:, 1:9]).aligned16
    assert not CallDesc.of_call(x, w, residual=buf[:, 1:9]).aligned16
