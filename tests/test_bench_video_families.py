"""bench.video's rows for the video VAEs beside the Wan family (tiny
configs on the CPU): each decodes patched as unpatched, its resnets fused."""

import json

import pytest

pytest.importorskip("diffusers")


@pytest.mark.parametrize("model", ["hunyuan-video", "ltx-video", "cogvideox", "mochi"])
def test_tiny_model_row(model, tmp_path, exact_fp32):
    """bench.video --model M --tiny: the decode row of a VAE whose Conv3d
    calls are planned like any (none skipped, each with its route), equal to
    the unpatched decode (fp32 convs exact, not TF32, on both sides), its
    latent sized by the model's own compression ratios, its resnets fused."""
    from bench import video
    video.main(["--model", model, "--tiny", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    (path,) = tmp_path.glob(f"video-{model}-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert {"name", "baseline", "baseline_ms", "ours_ms", "speedup"} <= set(row)
    assert row["rel_err_vs_unpatched"] < 1e-5 and row["patched_convs"] > 0 and row["fused_blocks"] > 0
    assert not row["skipped_convs"] and row["conv_routes"]


def test_block_peaks_pairs_each_decoder_block(tmp_path, monkeypatch):
    """--block-peaks: one row per decoder block, unpatched beside patched, in
    call order; what a block leaves allocated is read from the allocator
    (faked here: the CPU has no peak statistics)."""
    from bench import video
    counter = iter(range(0, 10 ** 9, 2 ** 20))  # 1 MiB more at each read
    monkeypatch.setattr(video, "_allocated", lambda device: next(counter))
    video.main(["--model", "ltx-video", "--tiny", "--no-decode", "--block-peaks", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("video-ltx-video-*.json")
    rows = json.loads(path.read_text())["block_peaks"]
    names = [r["block"] for r in rows]
    assert names[0] == "conv_in" and "up_blocks.0" in names and len(names) == len(set(names))
    assert all(r["held_gib"] > 0 and r["baseline_held_gib"] > 0 and r["extra_gib"] == 0 for r in rows)
