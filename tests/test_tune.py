"""The tuner (``convpatch tune``) and the shape tracer behind it, under the
interpreter on tiny shapes: what it measures, what it rejects, and that the
table it writes loads and routes."""

import dataclasses
import json

import pytest
import torch

from conv_patch.tools import cli, tune
from conv_patch.routing import tables as config_tables, registry as routes
from conv_patch.tools.model_shapes import ConvCall, distinct_calls, family_convs
from conv_patch.routing.registry import Route
from conv_patch.routing.decide import decide
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
    real_conv2d = tune.functional.conv2d

    def sabotage(x, w, b, *a, config=None, **kw):
        if config is broken:
            return real_conv2d(x, w, None, *a, config=dict(cands[0]), **kw)
        return real_conv2d(x, w, b, *a, config=config, **kw)
    monkeypatch.setattr(tune.functional, "conv2d", sabotage)
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
    d = decide(call.spec, CallDesc(call.shape, torch.float16, "cpu", "nhwc", weight_dtype=torch.float16),
                     target, tbl, as_called=False)
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
    # One line, this run's: the base's runs are its history (docs/tuning-log.md).
    assert "second run" in t["source"] and "first run" not in t["source"] and "\n" not in t["source"]
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
    exact, _ = _cli_tune_taesd(tmp_path, 8, "encoder", "--stride", "2", "--graph")
    assert len(exact) == 3 and all(".s2x2." in k for k in exact)
    assert "CUDA-graph replays" in json.loads((tmp_path / "t.json").read_text())["source"]


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


def test_config_labels_read_back_to_their_configs():
    """--from-report rebuilds configs from the labels a report holds: every
    candidate of every route must come back exactly, anything else not."""
    sm90 = dataclasses.replace(target_for(torch.device("cpu")), arch="sm90", interpreter=False)
    cands = tune.candidates(sm90) + routes.INTERPRETER_CANDIDATES
    cands += routes.tuner_candidates(sm90, "conv3d")
    assert any(c.get("persistent") for c in cands) and any("BLOCK_W" in c for c in cands)
    assert any(c.get("BLOCK_N2") for c in cands)
    for c in cands:
        assert tune.config_of_label(tune.config_label(c)) == c
    for bad in ("cudnn", "tma 128x128 nw4 s3", "igemm 128x128x32 nw4 s3 q2", "tma 128x128x64 wide nw4 s3", ""):
        assert tune.config_of_label(bad) is None, bad


def test_few_channel_buckets_only_where_their_route_wins():
    """Taps and flat buckets are looked up before the general ones, so one is
    written only where its route beat TMA and the portable kernel over the
    same convs: 64 -> 3 at 8x8 goes to TMA, at 128x128 to taps."""
    taps, tma, ig = "taps 128x32x64 nw4 s3", "tma 128x128x64 w128 nw4 s3", "igemm 128x128x32 nw4 s3"

    def measured(h, times):
        call = ConvCall(ConvSpec.from_module(torch.nn.Conv2d(64, 3, 3, 1, 1)), (1, 64, h, h), f"t{h}")
        return tune.Measurement(f"k{h}", call, "nhwc", h * h, True, times, {}, None,
                                {lab: tune.config_of_label(lab) for lab in times})
    ms = [measured(8, {taps: 2.0, tma: 1.0, ig: 1.5}), measured(128, {taps: 1.0, tma: 2.0, ig: 1.5})]
    buckets = [(tune.config_label(b["config"]), b["max_m"])
               for b in tune.build_table(ms, "sm90", torch.bfloat16)["conv2d"]["buckets"]]
    assert (taps, 16384) in buckets and (taps, 4096) not in buckets
    assert [lab for lab, m in buckets if m == 4096][0] == tma
    # Closed below: the 8x8 conv must not fall through to the 16384 taps bucket.
    table = config_tables.Table(tune.build_table(ms, "sm90", torch.bfloat16), "t")
    assert table.lookup(ms[0].call.spec, ms[0].call.shape, "nhwc", torch.bfloat16, 64)[0]["route"] == "tma"
    assert table.lookup(ms[1].call.spec, ms[1].call.shape, "nhwc", torch.bfloat16, 128 * 128)[0]["route"] == "taps"


def test_tune_missing_and_from_report_extend_a_base_table(tmp_path, capsys):
    """--missing measures only what the base lacks; --from-report re-derives
    the buckets and 'any' from reports without measuring, keeping the base's
    exact entries."""
    if not target_for(torch.device("cpu")).kernels:
        pytest.skip("needs the interpreter")
    common = ["tune", "--family", "taesd", "--batch", "1", "--layout", "nhwc", "--part", "decoder",
              "--device", "cpu", "--max-out-channels", "3"]
    t1, r1 = tmp_path / "t1.json", tmp_path / "r1.jsonl"
    assert cli.main(common + ["--res", "16", "--out", str(t1), "--report", str(r1)]) == 0
    first = json.loads(t1.read_text())["conv2d"]["exact"]
    t2, r2 = tmp_path / "t2.json", tmp_path / "r2.jsonl"
    assert cli.main(common + ["--res", "16", "24", "--base", str(t1), "--missing", "--out", str(t2),
                              "--report", str(r2)]) == 0
    rows2 = [json.loads(line) for line in r2.read_text().splitlines()]
    assert rows2 and not {r["key"] for r in rows2} & set(first)  # the 16 px shapes were not measured again
    second = json.loads(t2.read_text())["conv2d"]["exact"]
    assert set(first) < set(second) and all(second[k] == first[k] for k in first)
    # The reports back into a table: exact entries untouched, ranges from both reports.
    base = json.loads(t2.read_text())
    base["conv2d"]["buckets"] = []
    kept = next(iter(first))
    base["conv2d"]["exact"][kept] = {"route": "cudnn"}  # unlike the report: must survive
    base["conv2d"]["any"] = {"route": "igemm", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
    t3, t4 = tmp_path / "t3.json", tmp_path / "t4.json"
    t3.write_text(json.dumps(base))
    capsys.readouterr()
    assert cli.main(common + ["--res", "16", "24", "--base", str(t3), "--from-report", str(r1), str(r2),
                              "--out", str(t4)]) == 0
    assert f"{len(first) + len(rows2)} shape keys read back" in capsys.readouterr().out
    rebuilt = config_tables.load_user_table(str(t4)).data["conv2d"]
    assert rebuilt["exact"] == base["conv2d"]["exact"] and rebuilt["buckets"]
    assert rebuilt["any"] != base["conv2d"]["any"]


@pytest.mark.parametrize("extra,match", [
    (["--from-report", "{bad}"], "bad.jsonl: line 2 is not a line of a convpatch tune --report"),
    (["--from-report", "{tmp}/none.jsonl"], "none.jsonl: cannot read the report"),
    (["--from-report", "{bad}", "--missing"], "cannot go with --exact-only or --missing"),
    (["--from-report", "{other}"], "no line has the key of a shape"),
])
def test_cli_tune_from_report_bad_input_is_one_line_exit_2(tmp_path, capsys, extra, match):
    bad, other = tmp_path / "bad.jsonl", tmp_path / "other.jsonl"
    bad.write_text('{"key": "k", "times": {}}\nnot json\n')
    other.write_text('{"key": "n1.c1.h1.w1.o1.k1x1.s1x1.p0x0.d1x1.nhwc.bfloat16", "times": {}}\n')
    base = tmp_path / "base.json"
    base.write_text(json.dumps(config_tables.packaged_table("default").data))
    extra = [a.format(bad=bad, tmp=tmp_path, other=other) for a in extra]
    out = tmp_path / "out.json"
    rc = cli.main(["tune", "--family", "taesd", "--res", "16", "--batch", "1", "--base", str(base),
                   "--out", str(out)] + extra)
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert cli.main(["tune", "--missing"]) == 2 and "works on a --base table" in capsys.readouterr().err
