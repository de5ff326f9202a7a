"""The benchmarks' logic (shape lists, routing labels, row format, result
files) on tiny shapes; on the CPU the kernels run under the interpreter and
the times mean nothing, on a GPU these are quick real runs."""

import json
import os
from pathlib import Path

import pytest

ROW_KEYS = {"name", "baseline", "baseline_ms", "ours_ms", "speedup"}
SHARED = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")


def _result(tmp_path, prefix):
    files = list(tmp_path.glob(f"{prefix}-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert {"gpu", "torch", "triton", "date", "rows"} <= set(doc)
    return doc


def test_bench_layers_rows(tmp_path):
    from bench import layers
    layers.main(["--families", "taesd", "--res", "16", "--parts", "decoder", "--limit", "2",
                 "--rounds", "1", "--out", str(tmp_path)])
    doc = _result(tmp_path, "layers")
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2  # 2 convs x 2 layouts x plain/fused
    for r in rows:
        assert ROW_KEYS | {"tflops", "pct_of_peak", "route"} <= set(r)
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ours_ms"])
        assert r["rel_err_vs_fp32"] < 2e-2, r
    assert sum(r["name"].endswith("fused") for r in rows) == 4
    assert {"nhwc", "nchw", "nhwc_fused", "nchw_fused"} <= set(doc["summary"])
    assert not doc["graph"] and {r["timing"] for r in rows} == {"launched"}
    layers.main(["--families", "taef2", "--res", "16", "--parts", "decoder", "--kernel", "1", "--no-fused",
                 "--rounds", "1", "--out", str(tmp_path / "k1")])
    assert {r["name"].split()[3] for r in _result(tmp_path / "k1", "layers")["rows"]} == {"k1x1"}
    with pytest.raises(SystemExit):  # TAESD has no 1x1 conv
        layers.main(["--families", "taesd", "--res", "16", "--kernel", "1"])


@pytest.mark.gpu
def test_graph_replay_redoes_the_captured_work():
    """bench.layers --graph times a graph's replays: the replay must redo
    the captured conv-patch call on the inputs' current values."""
    import torch

    from conv_patch import functional
    from conv_patch.tools.tune import graph_replay
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 64, 40, 24, device="cuda", generator=g, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(96, 64, 3, 3, device="cuda", generator=g, dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last) * 0.05
    out = torch.empty(1, 96, 40, 24, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    replay = graph_replay(lambda: functional.conv2d(x, w, None, (1, 1), (1, 1), (1, 1), out=out))
    x.copy_(torch.randn(x.shape, device="cuda", generator=g))
    out.fill_(float("nan"))
    replay()
    ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not (SHARED / "models" / "taef2_decoder.safetensors").is_file(), reason="no ../shared/models")
def test_bench_vae_rows(tmp_path):
    from bench import vae
    vae.main(["--models", "taef2", "--res", "16", "--parts", "decode", "--runs", "1", "--warmup", "0",
              "--dtype", "fp32", "--out", str(tmp_path), "--profile", "--graph", "--idle", "0.01", "--clocks",
              "--table", str(Path(__file__).resolve().parents[1] / "configs" / "default.json")])
    rows = _result(tmp_path, "vae")["rows"]
    assert len(rows) == 1 and rows[0]["name"] == "taef2 decode 16x16"
    r = rows[0]
    assert ROW_KEYS | {"peak_gib", "channels_last_ms", "first_call_s", "convs_only_ms", "profile", "graphed_ms",
                       "idle_s", "clocks", "table_ms"} <= set(r)
    assert r["idle_s"] == 0.01 and set(r["clocks"]) == {"eager_nchw", "eager_channels_last", "convs_only",
                                                        "patched", "graphed", "table"}
    assert r["table"].endswith("default.json") and r["table_ms"] > 0
    assert r["profile"] and all(len(p) == 3 and p[2] >= 0 for p in r["profile"])
    assert r["baseline"] == "eager nchw" and r["ours_ms"] > 0


def test_bench_grouped_conv_rows(tmp_path):
    from bench import grouped_conv
    rows = grouped_conv.main(["--shapes", "1x12x5x7g3", "1x6x5x4dw3", "--rounds", "1", "--out", str(tmp_path)])
    assert [r["name"] for r in rows] == ["pointwise 1x12x5x7g3 nhwc", "depthwise 1x6x5x4dw3 nhwc"]
    assert all(r["rel_err"] <= 2 * r["baseline_rel_err"] + 1e-6 for r in rows)
    assert _result(tmp_path, "grouped_conv")["rows"][1]["speedup"] > 0


def test_bench_group_norm_rows(tmp_path):
    from bench import group_norm
    group_norm.main(["--shapes", "1x12x5x7", "--groups", "3", "--rounds", "1", "--out", str(tmp_path)])
    rows = _result(tmp_path, "group_norm")["rows"]
    assert [r["name"] for r in rows] == ["group_norm(3)+silu 1x12x5x7 nchw", "group_norm(3)+silu 1x12x5x7 nhwc"]
    assert _result(tmp_path, "group_norm")["groups"] == 3
    tol = 1e-5 if rows[0]["dtype"] == "float32" else 1e-2  # bf16 on a GPU
    assert all(ROW_KEYS | {"tbs", "rel_err"} <= set(r) and r["rel_err"] < tol for r in rows)


def test_bench_rms_norm_rows(tmp_path):
    from bench import rms_norm
    rms_norm.main(["--shapes", "1x12x3x5x7", "--rounds", "1", "--out", str(tmp_path)])
    rows = _result(tmp_path, "rms_norm")["rows"]
    assert [r["name"] for r in rows] == ["rms_norm+silu 1x12x3x5x7 ncdhw", "rms_norm+silu 1x12x3x5x7 ndhwc"]
    tol = 1e-5 if rows[0]["dtype"] == "float32" else 1e-2  # bf16 on a GPU
    assert all(ROW_KEYS | {"tbs", "rel_err"} <= set(r) and r["rel_err"] < tol for r in rows)


def test_bench_attention_rows(tmp_path):
    from bench import attention
    attention.main(["--tokens", "37", "--dim", "20", "--rounds", "1", "--out", str(tmp_path)])
    rows = _result(tmp_path, "attention")["rows"]
    assert [r["name"] for r in rows] == ["attention N=37 D=20"]
    cpu = rows[0]["dtype"] == "float32"  # on a GPU: bf16, and a narrow head goes to SDPA
    assert ROW_KEYS <= set(rows[0]) and rows[0]["route"] == ("fused" if cpu else "sdpa")
    assert rows[0]["rel_err"] <= (1e-5 if cpu else 1e-2)
    if cpu:
        # The cuBLAS route, timed beside the fused one, is checked too.
        assert rows[0]["blocked_ms"] > 0 and rows[0]["blocked_rel_err"] <= 1e-5


def test_bench_tma_epilogue_rows(tmp_path):
    from bench import tma_epilogue
    from conv_patch.target import target_for
    import torch
    if not target_for(torch.device("cuda" if torch.cuda.is_available() else "cpu")).kernels:
        pytest.skip("no kernels here")
    cfg = {"route": "tma", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_W": 8, "num_warps": 4,
           "num_stages": 2}
    tma_epilogue.main(["--res", "8", "--limit", "2", "--config", json.dumps(cfg), "--rounds", "1",
                       "--out", str(tmp_path)])
    rows = _result(tmp_path, "tma_epilogue")["rows"]
    assert [r["name"] for r in rows] == ["conv 128->128 3x3 @8^2 +residual", "conv 128->128 3x3 @8^2"]
    assert all(ROW_KEYS | {"bit_equal", "config"} <= set(r) and r["bit_equal"] for r in rows)
    # Every TMA config of the A/B table has the pointer epilogue, nothing else changed.
    from conv_patch.routing import tables as config_tables
    table = tma_epilogue.pointer_table("sm90")
    orig = config_tables.packaged_table("sm90").data
    exact = table["conv2d"]["exact"]
    assert all(c.get("tma_io") is False for c in exact.values() if c.get("route") == "tma")
    assert {k: {kk: vv for kk, vv in c.items() if kk != "tma_io"} for k, c in exact.items()} == orig["conv2d"]["exact"]
    assert "tma_io" not in str(orig)


def test_clock_samples_are_attributed_to_the_calls_they_fall_in():
    import time
    from bench.common import clock_stats, parse_smi
    t0 = time.mktime(time.strptime("2026/12/01 02:40:54", "%Y/%m/%d %H:%M:%S"))
    text = "\n".join([
        "2026/12/01 02:40:54.100, 1980, 250.5, 0x0000000000000000",
        "2026/12/01 02:40:54.600, 1665, 699.0, 0x0000000000000004",
        "2026/12/01 02:40:55.100, 1440, 703.2, 0x0000000000000004",
        "timestamp, clocks.sm [MHz], power.draw [W], clocks_event_reasons.active",
        "2026/12/01 02:40:55.6",  # cut off
    ])
    samples = parse_smi(text)
    assert [s[1] for s in samples] == [1980, 1665, 1440] and samples[1][0] == pytest.approx(t0 + 0.6)
    late = clock_stats(samples, [(t0 + 0.5, t0 + 1.2)])
    assert late == {"sm_clock_mhz": 1552.5, "power_w": pytest.approx(701.1), "power_capped": 1.0, "samples": 2}
    assert clock_stats(samples, [(t0, t0 + 0.2), (t0 + 1.0, t0 + 1.2)])["power_capped"] == 0.5
    assert clock_stats(samples, [(t0 + 5, t0 + 6)]) is None


def test_bench_tma_tiles_rows(tmp_path):
    from bench import tma_tiles
    from conv_patch.target import target_for
    import torch
    if not target_for(torch.device("cuda" if torch.cuda.is_available() else "cpu")).kernels:
        pytest.skip("no kernels here")
    # 130 columns: one-row tiles of 128 and a second, mostly empty one per row.
    tma_tiles.main(["--shapes", "16,24,2,130,3", "--rounds", "1", "--repeat", "2", "--out", str(tmp_path)])
    rows = _result(tmp_path, "tma_tiles")["rows"]
    assert [r["name"] for r in rows] == [f"conv 16->24 3x3 @2x130 {v}" for v in tma_tiles.VARIANTS]
    assert all(ROW_KEYS | {"tflops", "config", "deterministic"} <= set(r) and r["deterministic"] for r in rows)
    assert [r.get("bit_equal_one_tile") for r in rows] == [None] * 4 + [True]


def test_bench_zoo_rows(tmp_path):
    """The zoo's logic on tiny configs: one row per (model, size, batch,
    dtype) with the result fields, the patched and graphed models computing
    what the unpatched one does."""
    from bench import zoo
    # (One model: the row logic is the same for every model; every TINY
    # config is built by test_bench_zoo_tiny_configs_build. The compact
    # upscaler: the fewest convs of the models with fused blocks to graph.)
    rows = zoo.main(["--tiny", "--only", "srvgg-x4", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    doc = _result(tmp_path, "zoo")
    assert [r["model"] for r in doc["rows"]] == ["srvgg-x4"] and len(rows) == 1
    for r in doc["rows"]:
        assert ROW_KEYS | {"graph_ms", "graph_speedup", "host_ms", "noise", "routes", "first_call_s",
                           "second_call_s"} <= set(r)
        assert r["first_call_s"] > 0 and r["second_call_s"] > 0
        lo, hi = r["speedup_round_iqr"]
        assert 0 < lo <= hi and r["noise_iqr"][0] <= 1.0 <= r["noise_iqr"][1] and r["runs"] == 1
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ours_ms"])
        assert r["rel_err_vs_unpatched"] < 1e-5 and r["graph_rel_err_vs_unpatched"] < 1e-5
        # A float32 model is its own float32 reference: the unpatched error 0.
        assert r["baseline_rel_err_vs_fp32"] == 0 and r["rel_err_vs_fp32"] < 1e-5 and r["err_ok"]
        assert r["kernel_convs"] > 0 and 0 < sum(r["routes"].values()) <= r["patched_convs"]
        assert r["peak_gib"] is None and r["baseline_peak_gib"] is None  # (no GPU: no peak)
    assert doc["geomean_speedup"] > 0


def test_bench_zoo_tiny_configs_build():
    """Every --tiny case builds and runs unpatched (plain PyTorch: fast)."""
    import torch

    from bench import zoo
    for name, size, batch, dt in zoo.TINY:
        fields, model, inputs = zoo.load_case(name, size, batch, dt, True, torch.device("cpu"))
        args, kwargs = inputs[0]
        with torch.inference_mode():
            model(*args, **kwargs)
        assert fields["model"] == name


def test_zoo_fp32_errors_compare_both_models_with_a_float32_copy():
    """The error check of issue 44: a half model's float32 copy is the
    reference, the patched error against it within 1.5x the unpatched one's
    (here a 'patched' model that adds noise fails it)."""
    import torch

    from bench import zoo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.SiLU(),
                                torch.nn.Conv2d(8, 3, 3, padding=1)).to(torch.bfloat16)
    x = torch.randn(1, 3, 9, 9).to(torch.bfloat16)
    good = zoo.fp32_errors(model, model, ((x,), {}))
    assert good["baseline_rel_err_vs_fp32"] > 1e-4 and good["rel_err_vs_fp32"] == good["baseline_rel_err_vs_fp32"]
    assert good["err_ok"]
    noisy = torch.nn.Sequential(model, torch.nn.Dropout(0.2).train())
    assert not zoo.fp32_errors(model, noisy, ((x,), {}))["err_ok"]


def test_bench_zoo_convs_only_variant(monkeypatch):
    """--convs-only adds the model patched with recipes=False to the same
    rounds: its own columns, its output the unpatched model's (a conv
    stack stands in for a zoo model: the logic, not the model, is tested)."""
    import torch

    from bench import zoo
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(4, 5, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(5, 3, 1))
    x = torch.randn(1, 3, 5, 6)
    fields = {"name": "stack", "model": "stack", "size": "5x6", "batch": 1, "dtype": "fp32"}
    monkeypatch.setattr(zoo, "load_case", lambda *a, **k: (fields, net, [((x,), {})]))
    r = zoo.bench_row("stack", 6, 1, "fp32", 3, 0, True, torch.device("cpu"), extra=["convs_only"])
    assert r["convs_only_speedup"] == pytest.approx(r["baseline_ms"] / r["convs_only_ms"])
    lo, hi = r["convs_only_round_iqr"]
    assert 0 < lo <= hi and r["convs_only_rel_err_vs_unpatched"] < 1e-5 and r["runs"] == 3
    assert "convs_only_ms" not in zoo.bench_row("stack", 6, 1, "fp32", 1, 0, True, torch.device("cpu"))


def test_bench_pack_groups_rows(tmp_path):
    """bench.pack_groups on tiny TAEF2: the patched model refreshes its packs
    in one grouped launch per call, and one by one with grouping off."""
    from bench import pack_groups
    pack_groups.main(["--tiny", "--only", "taef2", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    (r,) = _result(tmp_path, "pack-groups")["rows"]
    assert ROW_KEYS | {"per_conv_ms", "per_conv_host_ms"} <= set(r)
    assert (r["refreshes_grouped"], r["group_launches"]) == (0, 1) and r["refreshes_per_conv"] > 1


def test_bench_overhead_rows(tmp_path, monkeypatch):
    from bench import overhead
    monkeypatch.setenv("BENCH_OUT", str(tmp_path))
    overhead.main(n=1, rounds=1, warmup=0)
    names = {r["name"] for r in _result(tmp_path, "overhead")["rows"]}
    assert {"F.conv2d", "patched, lean route (planned call)", "plan: replayed launch"} <= names


def test_bench_big_tiny_rows(tmp_path):
    """bench.big --tiny on the CPU: one row per variant with its error
    against the fp32 reference, the banded variant's band report, and an
    error-map PNG per variant beside the JSON."""
    pytest.importorskip("diffusers")
    from bench import big
    big.main(["--tiny", "--sizes", "16", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    rows = _result(tmp_path, "big")["rows"]
    assert [r["variant"].split("-")[0] for r in rows] == ["patched", "bands", "diffusers"]
    for r in rows:
        assert ROW_KEYS | {"peak_gib", "max_abs", "mean_abs", "max_rel", "mean_rel", "gpus", "world_size"} <= set(r)
        assert r["ref"] == "fp32 eager" and not r["oom"]
    banded = rows[1]
    assert banded["bands"] > 1 and banded["max_rel"] < 1e-5
    assert {"staged", "staged_gib", "host_peak_gib", "first_call_ms", "first_call_pin_s"} <= set(banded)
    assert banded["first_call_ms"] > 0 and (banded["staged_gib"] > 0) == banded["staged"]
    assert len(list(tmp_path.glob("big-16-*-errmap.png"))) == 3


@pytest.mark.parametrize("gib", [None, []], ids=["default-budget", "no-budget"])
def test_bench_big_skips_eager_and_tiling(tmp_path, capsys, gib):
    """``--skip eager tiling`` (an 8192^2 run within a device call's limit):
    the patched rows alone, no eager baseline and not counted as out of
    memory; each variant reports its start and its time as it goes.
    ``--gib`` with no value: no banded row either."""
    pytest.importorskip("diffusers")
    from bench import big
    big.main(["--tiny", "--sizes", "16", "--runs", "1", "--warmup", "0", "--skip", "eager", "tiling",
              "--out", str(tmp_path)] + ([] if gib is None else ["--gib"]))
    rows = _result(tmp_path, "big")["rows"]
    assert [r["variant"].split("-")[0] for r in rows] == (["patched", "bands"] if gib is None else ["patched"])
    assert all(r["baseline_ms"] is None and not r["eager_oom"] and not r["eager_run"] for r in rows)
    printed = capsys.readouterr().out
    assert "patched, un-banded ..." in printed and "eager PyTorch" not in printed and "tiling" not in printed


def test_bench_big_takes_a_row_per_budget(tmp_path):
    """``--gib 20 10``: a banded row per budget (the smaller one in more
    bands), each exact against the fp32 reference."""
    pytest.importorskip("diffusers")
    from bench import big
    big.main(["--tiny", "--sizes", "16", "--runs", "1", "--warmup", "0", "--gib", "20", "10", "--out", str(tmp_path)])
    rows = _result(tmp_path, "big")["rows"]
    assert [r["variant"].split("-")[0] for r in rows] == ["patched", "bands", "bands", "diffusers"]
    assert rows[1]["variant"] != rows[2]["variant"] and rows[2]["bands"] >= rows[1]["bands"] > 1
    assert all(r["max_rel"] < 1e-5 for r in rows[1:3])


def test_bench_big_world_rows_under_torchrun(tmp_path, monkeypatch):
    """bench.big --world 2 --tiny: torchrun started here (gloo on the CPU),
    a row for the patched and the kernels-off parallel decode, each against
    rank 0's one-GPU decode (equal to it here), with the bytes the ranks
    exchanged."""
    pytest.importorskip("diffusers")
    from bench import big
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    big.main(["--tiny", "--world", "2", "--sizes", "16", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    doc = _result(tmp_path, "big")
    rows = doc["rows"]
    assert doc["world_size"] == 2 and [r["variant"] for r in rows] == ["parallel-2", "parallel-2-kernels-off"]
    for r in rows:
        assert ROW_KEYS | {"exchanged_bytes", "vs_kernels_off", "one_gpu_peak_gib", "world_size"} <= set(r)
        assert r["world_size"] == 2 and r["baseline"] == "one-GPU patched decode" and not r["oom"]
        assert r["max_rel"] < 1e-5 and r["exchanged_bytes"] > 0


def test_fast_models_get_more_rounds():
    """A row's rounds span ``MIN_SECONDS`` of the unpatched model's time:
    a 4 ms model gets many more than a 400 ms one, never above MAX_RUNS,
    never fewer than asked."""
    from bench import zoo
    assert zoo.runs_for(400.0, 7, 0.5) == 7
    assert zoo.runs_for(20.0, 7, 0.5) == 25
    assert zoo.runs_for(4.0, 7, 0.5) == zoo.MAX_RUNS
    assert zoo.runs_for(4.0, 7, 0.0) == 7
    assert zoo.runs_for(4.0, 7, 0.5, max_runs=9) == 9


def test_interleaving_rotates_the_order_every_round(monkeypatch):
    """Each variant runs first, and right after each other variant, as
    often as any: a fixed A B C order made B always inherit A's state."""
    from bench import common, zoo
    monkeypatch.setattr(common, "time_ms", lambda fn, **kw: fn() or 1.0)
    calls = []
    fns = [lambda n=n: calls.append(n) for n in "abc"]
    common.interleaved_ms(fns, rounds=3)
    assert "".join(calls) == "abcbcacab"
    calls.clear()
    res = zoo.interleaved({n: f for n, f in zip("abc", fns)}, runs=2, warmup=1)
    assert "".join(calls) == "abcbcacab" and all(len(r["samples"]) == 2 for r in res.values())


def test_bench_video_tiny_rows(tmp_path):
    """bench.video --tiny --layers on the CPU: the model row (patched equal
    to unpatched) and one row per distinct Conv3d call of the decode, each
    candidate tile checked against exact fp32; --write-table merges them into
    a copy of a config table as valid conv3d entries the dispatch core reads
    (and keeps the table's conv2d section)."""
    pytest.importorskip("diffusers")
    from bench import video
    from conv_patch.routing import tables as config_tables
    table = tmp_path / "sm90.json"
    packaged = json.loads((Path(__file__).parents[1] / "configs" / "sm90.json").read_text())
    table.write_text(json.dumps(packaged))
    video.main(["--tiny", "--layers", "--runs", "1", "--warmup", "0", "--out", str(tmp_path),
                "--write-table", str(table)])
    doc = _result(tmp_path, "video-wan2.1")
    model, *layers = doc["rows"]
    assert ROW_KEYS <= set(model) and model["rel_err_vs_unpatched"] < 1e-5 and model["patched_convs"] > 0
    assert model["fused_blocks"] > 0
    # The first patched call (builds and compiles) is a row field of its own.
    assert model["first_call_s"] > 0 and model["baseline_first_call_s"] > 0
    assert layers and doc["layer_geomean_speedup"] > 0
    assert any(not r["name"].endswith("cache 0") for r in layers)  # the causal convs' cached frames
    for r in layers:
        assert ROW_KEYS <= set(r) and not r["rejected"] and r["times"]  # (the TMA tile skips NCDHW calls)
    # Keyed by the call's padding, as the dispatch core looks calls up: a
    # causal 3x3x3 conv after one cached frame pads time by 1 in front.
    cached = [r for r in layers if r["name"].endswith("cache 1") and "k3x3x3" in r["name"]]
    assert cached and all(".p1/0x1x1." in r["key"] for r in cached)
    written = config_tables.load_user_table(str(table))
    assert written.data["conv2d"] == packaged["conv2d"]
    for r in layers:
        entry = written.conv3d_exact(r["key"])
        assert entry["cudnn_ms"] == round(r["baseline_ms"], 5) and entry["ours_ms"] == round(r["ours_ms"], 5)


def test_bench_video_tiling_decodes_tiles_both_ways(tmp_path, monkeypatch):
    """bench.video --tiling: the unpatched and the patched model both
    decode through diffusers' tiled path (tiles along both axes of a 3x2
    latent under --tiny), equal to each other, in a row named as tiled."""
    diffusers = pytest.importorskip("diffusers")
    from bench import video
    cls = diffusers.AutoencoderKLLTXVideo
    tiled = cls.tiled_decode
    seen = {"tiled": 0}

    def counted(self, *a, **k):
        seen["tiled"] += 1
        return tiled(self, *a, **k)

    monkeypatch.setattr(cls, "tiled_decode", counted)
    video.main(["--tiny", "--tiling", "--model", "ltx-video", "--runs", "1", "--warmup", "0", "--out", str(tmp_path),
                "--name", "t"])
    (row,) = _result(tmp_path, "t")["rows"]
    assert row["name"].endswith(" tiled") and row["tiling"] and row["tile"] == [64, 64]
    assert ROW_KEYS <= set(row) and row["rel_err_vs_unpatched"] < 1e-5 and row["patched_convs"] > 0
    assert seen["tiled"] == 2  # one decode each, unpatched and patched


def test_bench_video_host_profile_of_both_decodes():
    """bench.video --host-top: the Python functions taking the most host
    time in an unpatched and in a patched decode, after a warm-up of each."""
    import torch
    from torch import nn
    from bench import video

    class Vae(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(3, 4, 1)
            self.decodes = 0

        def decode(self, z):
            self.decodes += 1
            return self.conv(z)
    vae = Vae().eval()
    out = video.host_profile(vae, torch.randn(1, 3, 2, 4, 4), top=40, calls=2)
    assert vae.decodes == 3  # (the patched copy's are its own)
    for key in ("baseline", "ours"):
        assert out[key] and all(h["function"] and h["calls"] > 0 and h["ms"] >= 0 for h in out[key]), out[key]
    # (The patched decode runs other Python than the unpatched one: its own rows.)
    assert {h["function"] for h in out["ours"]} != {h["function"] for h in out["baseline"]}


def test_bench_video_flops_match_the_decodes_convs(tmp_path):
    """bench.video --flops --no-decode: the decode's arithmetic, counted on
    the meta device, equals the convolutions' multiply-adds that a real
    decode of the same tiny clip runs (counted from each conv's output here),
    and the floor is that arithmetic at the stated peak."""
    pytest.importorskip("diffusers")
    import torch
    from torch import nn
    from bench import video
    video.main(["--tiny", "--flops", "--no-decode", "--out", str(tmp_path), "--name", "f"])
    doc = _result(tmp_path, "f")
    assert doc["rows"] == []
    frames, height, width = doc["frames"], doc["height"], doc["width"]
    vae = video.build_vae("wan2.1", True, torch.device("cpu"), torch.float32)
    macs = []

    def count(m, inputs, out):
        k = m.weight[0].numel()  # input channels / groups x kernel taps
        macs.append(out.numel() * k)

    for m in vae.modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)):
            m.register_forward_hook(count)
    with torch.no_grad():
        vae.decode(video.latents(vae, frames, height, width, torch.device("cpu"), torch.float32))
    assert macs and doc["conv_tflop"] * 1e12 == pytest.approx(2 * sum(macs), rel=1e-9)
    assert doc["conv_tflop"] <= doc["decode_tflop"]
    assert doc["floor_ms"] == pytest.approx(doc["decode_tflop"] / doc["peak_tflops"] * 1e3)


def test_bench_overhead_without_kernels_exits_with_one_line(monkeypatch):
    """On a CPU without the interpreter no kernel row can run: a one-line
    exit, not a traceback from the first kernel row."""
    from bench import overhead
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit, match="no GPU here"):
        overhead.main(n=1, rounds=1, warmup=0)


def test_bench_video_ndhwc_layers_alone(tmp_path):
    """bench.video --layers --layout ndhwc --no-decode: the Conv3d calls'
    rows alone, each measured on channels_last_3d inputs (keyed ndhwc, the
    TMA kernel's layout), checked against exact fp32."""
    pytest.importorskip("diffusers")
    from bench import video
    video.main(["--tiny", "--layers", "--no-decode", "--layout", "ndhwc", "--max-layers", "3", "--out", str(tmp_path),
                "--name", "v"])
    doc = _result(tmp_path, "v")
    assert doc["layers_layout"] == "ndhwc" and doc["rows"]
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r) and not r["rejected"] and r["times"]
    # (A 1x1-pixel frame is both layouts at once; the key says NCDHW there.)
    assert any(r["key"].endswith(".ndhwc.float32") for r in doc["rows"])


def test_bench_video_keeps_what_a_cut_run_measured(tmp_path, monkeypatch):
    """A bench.video run cut while it times a Conv3d call has written the
    decode row and every layer timed before it."""
    pytest.importorskip("diffusers")
    from bench import video
    from conv_patch.tools import tune

    class Cut(Exception):
        pass

    calls, real = [], tune.measure_conv3d

    def measure(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise Cut
        return real(*a, **k)

    monkeypatch.setattr(tune, "measure_conv3d", measure)
    with pytest.raises(Cut):
        video.main(["--tiny", "--layers", "--runs", "1", "--warmup", "0", "--max-layers", "4", "--out", str(tmp_path),
                    "--name", "v"])
    rows = _result(tmp_path, "v")["rows"]
    assert len(rows) == 3 and "decode" in rows[0]["name"] and all(r["times"] for r in rows[1:])


def test_bench_host_ops_rows(tmp_path, monkeypatch):
    """bench.host_ops --tiny: per model the host time, the PyTorch ops and
    Python calls of the unpatched and patched model per call, and the
    entries that differ (conv-patch's own functions on the patched side
    only). Without the interpreter, as on a GPU host's CPU side: every
    conv on PyTorch's route."""
    pytest.importorskip("diffusers")
    from bench import host_ops
    from conv_patch import target
    monkeypatch.setattr(target, "interpreter_enabled", lambda: False)
    rows = host_ops.main(["--tiny", "--only", "taef2", "--calls", "2", "--out", str(tmp_path)])
    doc = _result(tmp_path, "host-ops")
    assert [r["name"] for r in doc["rows"]] == [r["name"] for r in rows] == ["taef2 16x16 b1 fp32"]
    row = doc["rows"][0]
    assert ROW_KEYS <= set(row) and row["ours_ms"] == row["host_ms"]["patched"]
    assert set(row["host_ms"]) == {"unpatched", "patched"} and all(v > 0 for v in row["host_ms"].values())
    for side in ("unpatched", "patched"):
        assert row["totals"][side]["ops"] > 0 and row["totals"][side]["python_calls"] > 0
    names = {r["name"] for r in row["ops"]}
    assert "aten::convolution" in names or any(n.startswith("aten::") for n in names)
    assert row["routes"] == {"fallback": row["routes"]["fallback"]}
    ours = [r for r in row["functions"] if "bare_call" in r["name"]]
    assert ours and ours[0]["unpatched_n"] == 0 and ours[0]["patched_n"] > 0


def test_zoo_host_set_is_the_host_bound_rows():
    """--set host: rows of the full set, each a model the zoo builds."""
    from bench import zoo
    assert zoo.HOST and all(c in zoo.FULL and c[0] in zoo.MODELS for c in zoo.HOST)


def test_bench_video_profile_rows(tmp_path):
    """bench.video --profile N --no-decode: the profile of one patched decode
    in the result's ``profile`` (at most N entries, largest first, shares of
    the profiled time), and no model or layer rows."""
    pytest.importorskip("diffusers")
    from bench import video
    video.main(["--tiny", "--no-decode", "--profile", "4", "--out", str(tmp_path), "--name", "p"])
    doc = _result(tmp_path, "p")
    prof = doc["profile"]
    assert doc["rows"] == [] and 0 < len(prof) <= 4
    assert all({"kernel", "calls", "ms", "share"} <= set(r) and r["calls"] > 0 for r in prof)
    assert [r["ms"] for r in prof] == sorted((r["ms"] for r in prof), reverse=True)
    assert 0 < sum(r["share"] for r in prof) <= 1.0 + 1e-9


def test_bench_big_keeps_what_a_cut_run_measured(tmp_path, monkeypatch):
    """A run cut by its time limit while a variant runs (an 8192^2 eager
    decode takes minutes) has written every variant timed before it, as
    ``partial`` rows: their times and peaks, no error yet."""
    pytest.importorskip("diffusers")
    from bench import big

    class Cut(Exception):
        pass

    calls, real = [], big.measure

    def measure(fn, *a, **k):
        calls.append(1)
        if len(calls) == 4:  # the fp32 reference, eager, tiling, then the patched decode is cut
            raise Cut
        return real(fn, *a, **k)

    monkeypatch.setattr(big, "measure", measure)
    with pytest.raises(Cut):
        big.main(["--tiny", "--sizes", "16", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    rows = _result(tmp_path, "big")["rows"]
    assert [r["variant"] for r in rows] == ["eager", "diffusers-tiling"]
    assert all(r["partial"] and r["ours_ms"] > 0 and "max_rel" not in r for r in rows)


def test_bench_layout_row():
    """bench.layout's row on a tiny upscaler on the CPU (its logic, not its
    times): five variants, each the unpatched NCHW answer in NCHW."""
    pytest.importorskip("diffusers")
    import torch

    from bench import layout
    row = layout.layout_row("rrdb-x4", 8, 1, "fp32", 1, 0, torch.device("cpu"), graph=True, tiny=True)
    for k in ("nchw", "nhwc", "nhwc_input", "patched_nchw", "patched_nhwc"):
        assert row[f"{k}_ms"] > 0 and row[f"{k}_contiguous"], k
        assert row[f"{k}_rel_err"] <= 1e-5, (k, row[f"{k}_rel_err"])
    assert row["speedup"] == row["baseline_ms"] / row["ours_ms"] and "nchw_graph_ms" not in row


@pytest.mark.parametrize("name", ["dc-ae-decode", "ddpm-unet", "movq-decode", "asym-vae-decode", "svd-vae-decode",
                                  "srvgg-x4", "rrdb-spandrel-x4", "hunyuan-image-vae-decode", "edsr-x4"])
def test_untuned_zoo_architectures_patched_compute_what_they_compute(name, exact_fp32):
    """The zoo's architectures nobody tuned for (issue 44's "models nobody
    tuned for"), tiny, patched on the CPU under the interpreter: every conv
    wrapped or skipped with its reason (DC-AE's grouped convs: groups=N),
    the unpatched model's output."""
    pytest.importorskip("diffusers")
    import torch

    import conv_patch
    from bench import zoo
    assert name in {c[0] for c in zoo.UNTUNED} and name in {c[0] for c in zoo.FULL}
    size, batch, dt = next((s, b, d) for n, s, b, d in zoo.TINY if n == name)
    fields, model, inputs = zoo.load_case(name, size, batch, dt, True, torch.device("cpu"), 1)
    convs = sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) for m in model.modules())
    with torch.inference_mode():
        ref = zoo.model_output(model, inputs[0])
        report = conv_patch.apply(model)
        out = zoo.model_output(model, inputs[0])
    assert len(report.patched) + len(report.skipped) == convs and all(report.skipped.values()), report
    assert len(report.patched) > len(report.skipped)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5


def test_seeded_prelu_nets_stay_in_fp16_range():
    """``seeded_`` gives a PReLU a slope, not a scale: with slopes near 1
    the zoo's 34-conv SRVGG grew ~1.4x a layer and its fp16 row compared
    infinities (rel_err NaN). Every activation of the full-size net, seeded
    as the zoo seeds it, stays well inside fp16."""
    import torch

    from bench import zoo
    model, _ = zoo.srvgg_x4(False)
    zoo.seeded(model)
    biggest = []
    for m in model.body:
        m.register_forward_hook(lambda mod, a, o: biggest.append(o.abs().max().item()))
    with torch.no_grad():
        model(torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(0)))
    assert len(biggest) == len(model.body) and max(biggest) < 1e3, max(biggest)


def test_a_child_that_times_out_is_killed_with_the_processes_it_started(tmp_path):
    """A benchmark child past its timeout is reported as such, and the
    processes it started (Inductor's compile workers) die with it: they
    would go on writing into the temporary caches being deleted."""
    import time
    from bench.common import child_rows
    if not Path("/proc").is_dir():
        pytest.skip("reads the grandchild's state from /proc")
    pid_file = tmp_path / "grandchild.pid"
    (tmp_path / "cp_sleeper.py").write_text(
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n")
    t0 = time.monotonic()
    rows, error = child_rows("cp_sleeper", [], {"PYTHONPATH": str(tmp_path)}, timeout=5)
    assert rows is None and "timed out after 5" in error and time.monotonic() - t0 < 60
    pid = int(pid_file.read_text())
    for _ in range(50):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            break
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break  # dead, not yet reaped (PID 1 of a container may not)
        time.sleep(0.1)
    else:
        pytest.fail("the child's own process outlived its timeout")


def test_bench_lean_rows(tmp_path):
    """The lean forwards' benchmark: one row per block, each bit-equal to
    the block's own forward, in a results file."""
    from bench import lean
    rows = lean.main(["--tiny", "--rounds", "1", "--out", str(tmp_path)])
    assert [r["name"].split(" ")[0] for r in rows] == ["dense", "dense"]
    assert all(r["bit_equal"] and r["baseline_ms"] > 0 and r["ours_ms"] > 0 for r in rows)
    assert json.loads(next(tmp_path.glob("lean-*.json")).read_text())["rows"][0]["speedup"] > 0


def test_bench_ab_rows_and_rules(tmp_path):
    """The rule A/B: one row per variant, each computing the unpatched
    answer; a variant's rule holds inside its calls only."""
    from torch import nn

    from bench import ab
    from conv_patch.recipes import esrgan
    from conv_patch.routing import costs
    from conv_patch.runtime import pack
    rows = ab.main(["--only", "srvgg-x4", "--variants", "own-dense-blocks", "size-only-group-norm", "--tiny",
                    "--runs", "1", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == ["own-dense-blocks", "size-only-group-norm"]
    assert all(ROW_KEYS <= set(r) and r["rel_err_vs_unpatched"] < 1e-5 for r in rows)
    assert json.loads(next(tmp_path.glob("ab-*.json")).read_text())["variants"] == ["own-dense-blocks",
                                                                                 "size-only-group-norm"]
    assert esrgan.RESIDUAL_DENSE.unfused is None and esrgan.RRDB_RECIPE.unfused is None
    taef2_pool = (1 * 256 * 64 * 64, 4)
    with ab.VARIANTS["size-only-group-norm"][0]():
        assert not costs.group_norm_pays(*taef2_pool)
    assert costs.group_norm_pays(*taef2_pool)
    with ab.VARIANTS["own-dense-blocks"][0]():
        assert esrgan.RESIDUAL_DENSE.unfused(nn.Linear(1, 1), (), {}) == ()
        assert esrgan.RRDB_RECIPE.unfused(nn.Linear(1, 1), (), {}) == ()
        with pack.graph_path():
            assert esrgan.RRDB_RECIPE.unfused(nn.Linear(1, 1), (), {}) is None
    with ab.VARIANTS["own-rrdbs"][0]():
        assert esrgan.RESIDUAL_DENSE.unfused is None and esrgan.RRDB_RECIPE.unfused(nn.Linear(1, 1), (), {}) == ()
    from conv_patch.kernels import direct_launch
    from conv_patch.runtime import planner
    on = direct_launch.direct_launch_on()
    with ab.VARIANTS["triton-launcher"][0](), ab.VARIANTS["full-path"][0]():
        assert not direct_launch.direct_launch_on() and not planner.KERNEL_SLOTS
    assert direct_launch.direct_launch_on() == on and planner.KERNEL_SLOTS
    from conv_patch.routing import tables
    own = tables.packaged_table("sm90")
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"schema": 1, "arch": "sm90", "conv2d": {"any": {"BLOCK_M": 32, "BLOCK_N": 32,
                                                                                  "BLOCK_K": 16}}}))
    with ab._as_packaged(str(path)):
        assert tables.packaged_table("sm90").data["conv2d"]["any"]["BLOCK_M"] == 32
        assert tables.packaged_table("default").name == "default"
    assert tables.packaged_table("sm90").data == own.data
    from conv_patch.ops import grouped_conv
    conv = nn.Conv2d(4, 4, 1, groups=2)
    with ab.VARIANTS["cudnn-grouped-convs"][0]():
        assert grouped_conv.problem(conv, None) is not None
    assert grouped_conv.problem(conv, None) == "the input is not a 4-D tensor of the conv's channels"
    from conv_patch.runtime import graphs
    with ab.VARIANTS["no-auto-graphs"][0]():
        assert graphs.AUTO_POOL_BYTES == 0
    assert graphs.AUTO_POOL_BYTES == 1 << 30


def test_bench_video_first_call_compiled_ahead(tmp_path, exact_fp32):
    """bench.video --compile-ahead --tiny: the patched first call made by
    conv_patch.warmup on vae.decode (no pass runs on the CPU: its time is
    None), the decode as the unpatched one's."""
    pytest.importorskip("diffusers")
    from bench import video
    video.main(["--tiny", "--model", "wan2.1", "--runs", "1", "--warmup", "0", "--compile-ahead",
                "--out", str(tmp_path)])
    (row,) = _result(tmp_path, "video-wan2.1")["rows"]
    assert row["first_call_s"] > 0 and "first_call_compile_s" in row and row["first_call_compile_s"] is None
    assert row["rel_err_vs_unpatched"] < 1e-5
