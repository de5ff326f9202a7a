"""bench.video's rows for the video VAEs beside the Wan family (tiny
configs on the CPU): each decodes patched as unpatched, its resnets fused."""

import json

import pytest

pytest.importorskip("diffusers")


@pytest.mark.parametrize("model", ["hunyuan-video", "ltx-video", "cogvideox", "mochi"])
def test_tiny_model_row(model, tmp_path):
    from bench import video
    video.main(["--model", model, "--tiny", "--runs", "1", "--warmup", "0", "--out", str(tmp_path)])
    (path,) = tmp_path.glob(f"video-{model}-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["rel_err_vs_unpatched"] < 1e-5 and row["patched_convs"] > 0 and row["fused_blocks"] > 0
