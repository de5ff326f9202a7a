"""The tuner (``convpatch tune``) and the shape tracer behind it, under the
interpreter on tiny shapes: what it measures, what it rejects, and that the
table it writes loads and routes."""

import dataclasses
import json

import pytest
import torch

from conv_patch import cli, config_tables, tune
from conv_patch.model_shapes import ConvCall, distinct_calls, family_convs
from conv_patch.routing import Route, select_route
from conv_patch.specs import CallDesc, ConvSpec
from conv_patch.target import target_for


def test_flux_decoder_convs_traced_off_the_architecture():
    convs = family_convs("flux", 1024, parts=("decoder",))
    plain = {c: n for c, n in convs.items() if c.spec.kernel != (2, 2)}
    # conv_in, 2 mid resnets, 4 up blocks x 3 resnets, 3 upsamplers, shortcuts, conv_out
    assert sum(plain.values()) == 35
    shapes = {(c.spec.in_channels, c.spec.out_channels, c.spec.kernel[0], c.shape[2]) for c in convs}
    assert (16, 512, 3, 128) in shapes and (128, 3, 3, 1024) in shapes and (256, 128, 1, 1024) in shapes
    # Each upsampler's 3x3 conv also as the recipe runs it: four 2x2 convs of
    # the small input, one per output parity, with that parity's padding.
    subs = [c for c in convs if c.spec.kernel == (2, 2)]
    assert len(subs) == 12 and sum(convs[c] for c in subs) == 12
    assert {(c.spec.pad_begin, c.spec.pad_end) for c in subs} == {
        ((1, 1), (0, 0)), ((1, 0), (0, 1)), ((0, 1), (1, 0)), ((0, 0), (1, 1))}
    assert {(c.spec.in_channels, c.shape[2]) for c in subs} == {(512, 128), (512, 256), (256, 512)}
    # TAESD's Sequential chains fold theirs too.
    assert any(c.spec.kernel == (2, 2) and c.shape[2] == 32 for c in family_convs("taesd", 256, parts=("decoder",)))
    enc = family_convs("sd", 512, batch=4, parts=("encoder",))
    # SD's encoder pads (0,1,0,1) before its stride-2 convs, and ends in the 8->8 quant conv.
    assert any(c.spec.stride == (2, 2) and c.shape[2] == 513 for c in enc)
    # ... and the block recipe folds that pad: the form a patched encoder runs.
    assert any(c.spec.stride == (2, 2) and c.shape[2] == 512 and c.spec.pad_end == (1, 1)
               and c.spec.pad_begin == (0, 0) for c in enc)
    assert any(c.spec.in_channels == 8 and c.spec.kernel == (1, 1) for c in enc)
    assert all(c.shape[0] == 4 for c in enc)


def test_distinct_calls_dedupe_bias_and_keep_order():
    calls = distinct_calls(["taesd"], [16, 32], [1])
    keys = [(c.spec.in_channels, c.spec.out_channels, c.spec.kernel, c.spec.stride, c.spec.pad_begin, c.spec.pad_end,
             c.shape) for c in calls]
    assert len(keys) == len(set(keys))
    assert calls[0].where == "taesd decoder @16"
    with pytest.raises(ValueError, match="multiple of 8"):
        family_convs("taesd", 20)


def _tiny_calls():
    mk = lambda ci, co, k, s, h: ConvCall(  # noqa: E731
        ConvSpec.from_module(torch.nn.Conv2d(ci, co, k, s, k // 2)), (1, ci, h, h), "test")
    return [mk(16, 24, 3, 1, 8), mk(16, 8, 1, 1, 6), mk(5, 8, 3, 2, 7)]


def test_tune_measures_rejects_and_builds_a_table(monkeypatch):
    target = target_for(torch.device("cpu"))
    if not target.kernels:
        pytest.skip("needs the interpreter")
    cands = tune.candidates(target)
    # A candidate that computes the wrong answer must be caught: break one
    # igemm config by making the kernel skip its bias.
    broken = dict(cands[0], BLOCK_M=cands[0]["BLOCK_M"] // 2)
    real_conv2d = tune.ops.conv2d

    def sabotage(x, w, b, *a, config=None, **kw):
        if config is broken:
            return real_conv2d(x, w, None, *a, config=dict(cands[0]), **kw)
        return real_conv2d(x, w, b, *a, config=config, **kw)
    monkeypatch.setattr(tune.ops, "conv2d", sabotage)
    ms = tune.tune(_tiny_calls(), ["nhwc", "nchw"], torch.bfloat16, torch.device("cpu"), target,
                   cands=cands + [broken], timer=lambda fn: 1.0 + len(str(fn)) * 0)
    assert len(ms) == 6
    for m in ms:
        assert tune.config_label(broken) in m.rejected and "wrong output" in m.rejected[tune.config_label(broken)]
        assert m.best is not None and m.cudnn_ms is None
    strided = [m for m in ms if m.call.spec.stride == (2, 2)]
    assert strided and not any(m.tma_ok for m in strided)
    # 5 input channels: the flat route is a candidate there too, TMA is not.
    assert {k.split()[0] for m in strided for k in m.times} == {"igemm", "flat"}
    table = tune.build_table(ms, "interpreter", torch.bfloat16, "test")
    assert len(table["conv2d"]["exact"]) == 6 and table["conv2d"]["buckets"]
    tbl = config_tables.Table(table, "t")
    call = _tiny_calls()[0]
    d = select_route(call.spec, CallDesc(call.shape, torch.float16, "cpu", "nhwc", weight_dtype=torch.float16),
                     target, tbl)
    assert d.tier == "exact" and d.route in (Route.CONV2D_TMA, Route.CONV2D_IGEMM)


def test_tune_measures_a_folded_downsample_pad_on_the_tma_route():
    target = target_for(torch.device("cpu"))
    if not target.kernels:
        pytest.skip("needs the interpreter")
    spec = dataclasses.replace(ConvSpec.from_module(torch.nn.Conv2d(16, 16, 3, 2, 0)), pad_end=(1, 1))
    cands = [c for c in tune.candidates(target) if c.get("route") == "tma"][:2]
    cands += [c for c in tune.candidates(target) if c.get("route", "igemm") == "igemm"][:1]
    (m,) = tune.tune([ConvCall(spec, (1, 16, 8, 8), "test")], ["nhwc"], torch.bfloat16, torch.device("cpu"),
                     target, cands=cands, timer=lambda fn: 1.0)
    assert m.key.endswith("bfloat16") and "/b1x1" in m.key and m.tma_ok
    assert not m.rejected and len(m.times) == 3  # every candidate matched F.pad + F.conv2d


def test_cudnn_wins_only_by_the_margin():
    call = _tiny_calls()[0]
    cfg = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    m = tune.Measurement("k", call, "nhwc", 64, False, {"a": 1.0}, {}, 0.97, {"a": cfg})
    assert tune.exact_entry(m)["route"] == "igemm"  # within the noise margin: ours
    m.cudnn_ms = 0.5
    e = tune.exact_entry(m)
    assert e["route"] == "cudnn" and e["ours_ms"] == 1.0 and e["best_kernel"] == "a"


def test_base_table_entries_survive_a_partial_retune():
    call = _tiny_calls()[0]
    cfg = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    m = tune.Measurement("new.key", call, "nchw", 64, False, {"a": 1.0}, {}, None, {"a": cfg})
    base = {"conv2d": {"exact": {"old.key": dict(cfg), "new.key": {"route": "cudnn"}},
                       "buckets": [{"max_m": None, "layouts": ["nhwc"], "config": dict(cfg)},
                                   {"max_m": None, "layouts": ["nchw"], "config": dict(cfg, BLOCK_M=128)}],
                       "any": dict(cfg)}, "source": "first run"}
    t = tune.build_table([m], "sm90", torch.bfloat16, "second run", base)
    assert t["conv2d"]["exact"]["new.key"]["route"] == "igemm" and "old.key" in t["conv2d"]["exact"]
    layouts = [b.get("layouts") for b in t["conv2d"]["buckets"]]
    assert ["nhwc"] in layouts and all(b["config"]["BLOCK_M"] == 64 for b in t["conv2d"]["buckets"])
    assert "first run" in t["source"] and "second run" in t["source"]
    # exact_only: the base's buckets (both layouts) and 'any' stay untouched.
    t = tune.build_table([m], "sm90", torch.bfloat16, "third run", base, exact_only=True)
    assert t["conv2d"]["buckets"] == base["conv2d"]["buckets"] and t["conv2d"]["any"] == base["conv2d"]["any"]
    assert t["conv2d"]["exact"]["new.key"]["route"] == "igemm" and "old.key" in t["conv2d"]["exact"]
    with pytest.raises(ValueError, match="no base"):
        tune.build_table([m], "sm90", torch.bfloat16, "x", None, exact_only=True)
    assert cli.main(["tune", "--exact-only", "--device", "cpu"]) == 2


def _cli_tune_taesd(tmp_path, res, part, *extra):
    """``convpatch tune`` of TAESD on the CPU: (the table's exact entries,
    the report's rows)."""
    if not target_for(torch.device("cpu")).kernels:
        pytest.skip("needs the interpreter")
    out, rep = tmp_path / "t.json", tmp_path / "r.jsonl"
    rc = cli.main(["tune", "--family", "taesd", "--res", str(res), "--batch", "1", "--layout", "nhwc",
                   "--part", part, "--device", "cpu", *extra, "--out", str(out), "--report", str(rep)])
    assert rc == 0
    table = config_tables.load_user_table(str(out))
    assert "taesd" in table.data["source"]
    return table.data["conv2d"]["exact"], [json.loads(line) for line in rep.read_text().splitlines()]


def test_cli_tune_writes_a_table_that_loads(tmp_path, capsys):
    exact, rows = _cli_tune_taesd(tmp_path, 16, "decoder")
    assert exact and len(rows) == len(exact) and rows[0]["best"]
    assert "wrote" in capsys.readouterr().out


def test_cli_tune_stride_keeps_the_downsampling_convs(tmp_path):
    exact, _ = _cli_tune_taesd(tmp_path, 8, "encoder", "--stride", "2")
    assert len(exact) == 3 and all(".s2x2." in k for k in exact)


def test_cli_tune_max_out_channels_measures_the_taps_route(tmp_path):
    """--max-out-channels 3: only TAESD's conv_out, where the few-output-
    channel route is a candidate and is measured (checked, timed) too."""
    exact, rows = _cli_tune_taesd(tmp_path, 16, "decoder", "--max-out-channels", "3")
    assert exact and all(".o3." in k for k in exact)
    assert all(any(lab.startswith("taps") for lab in r["times"]) for r in rows), rows


@pytest.mark.parametrize("argv,match", [
    (["--res", "20"], "multiples of 8"),
    (["--out", "/nonexistent/dir/t.json"], "cannot write there"),
    (["--base", "/nonexistent/base.json"], "cannot read the config table"),
])
def test_cli_tune_bad_input_is_one_line_exit_2(argv, match, capsys, device):
    rc = cli.main(["tune", "--device", str(device), "--family", "taesd"] + argv)
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1
