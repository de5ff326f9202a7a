"""``convpatch verify PATH``: formats, reports, and every kind of bad input.

Each bad-input test builds its own file and checks: exit code 2, one line on
stderr naming the file and the problem, no traceback, the file untouched.
"""

import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conv_patch.tools import cli, taesd
from conv_patch import functional
from conv_patch.ops import conv2d as conv2d_op

SHARED = Path(os.environ.get("CONV_PATCH_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
HAVE_TAEF2 = (SHARED / "models" / "taef2_decoder.safetensors").exists()


def run_cli(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def raw_safetensors(path, header, data=b"", header_len=None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + blob + data)
    return path


def conv_entry(begin, shape=(2, 2, 1, 1), dtype="F32", itemsize=4):
    n = itemsize
    for d in shape:
        n *= d
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + n]}


def _fingerprint(path):
    if not os.path.isfile(path):
        return None
    st = os.stat(path)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest(), st.st_mtime_ns, st.st_size


def _write(path, data):
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def _truncated(d):
    """A real file with its last bytes cut off, as an interrupted download leaves it."""
    p = d / "cut.safetensors"
    save_file({"conv.weight": torch.randn(8, 4, 3, 3), "conv.bias": torch.randn(8)}, str(p))
    return _write(p, p.read_bytes()[:-100])


def _sparse_with_header_length(path, n):
    """A sparse file as large as its header length field claims (1 GiB of
    holes): the reader must refuse the length, not read and decode it."""
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n + 16)
    return path


def _good_file(tmp_path):
    p = tmp_path / "good.safetensors"
    save_file({"conv.weight": torch.randn(4, 3, 3, 3)}, str(p))
    return p


BAD_INPUTS = {
    "missing": (lambda d: d / "nope.safetensors", "no such file"),
    "directory": (lambda d: d, "is a directory"),
    "not_safetensors": (lambda d: _write(d / "notes.safetensors", "hello, this is text\n" * 5),
                        "not a safetensors file"),
    "empty": (lambda d: _write(d / "empty.safetensors", b""), "empty file"),
    "too_short": (lambda d: _write(d / "short.safetensors", b"\x01\x02"), "too short"),
    "truncated": (_truncated, "truncated file"),
    "header_longer_than_file": (lambda d: raw_safetensors(d / "h.safetensors", {"a": conv_entry(0)},
                                                           bytes(16), header_len=10**9), "header length"),
    "header_not_json": (lambda d: raw_safetensors(d / "j.safetensors", b"{not json at all"), "not JSON"),
    "header_not_object": (lambda d: raw_safetensors(d / "l.safetensors", [1, 2, 3]), "not an object"),
    "offsets_past_end": (lambda d: raw_safetensors(d / "o.safetensors", {"c.weight": conv_entry(0)}, bytes(8)),
                         "runs past the end"),
    "overlapping": (lambda d: raw_safetensors(
        d / "ov.safetensors", {"a.weight": conv_entry(0), "b.weight": conv_entry(8)}, bytes(24)), "overlap"),
    "shape_bytes_disagree": (lambda d: raw_safetensors(
        d / "s.safetensors", {"c.weight": {"dtype": "F32", "shape": [2, 2, 3, 3], "data_offsets": [0, 16]}},
        bytes(16)), "declares shape"),
    "unknown_dtype": (lambda d: raw_safetensors(
        d / "u.safetensors", {"c.weight": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, bytes(1)),
        "unknown dtype 'Q7'"),
    "huge_declared_size": (lambda d: raw_safetensors(
        d / "huge.safetensors",
        {"c.weight": {"dtype": "F32", "shape": [2**20, 2**20, 3, 3], "data_offsets": [0, 2**45]}}, bytes(16)),
        "runs past the end"),
    "gap_in_data": (lambda d: raw_safetensors(
        d / "gap.safetensors", {"a.weight": conv_entry(0), "b.weight": conv_entry(32)}, bytes(48)), "gap"),
    "no_conv_weights": (lambda d: save_file({"linear.weight": torch.randn(4, 4), "bias": torch.randn(4)},
                                            str(d / "lin.safetensors")) or d / "lin.safetensors",
                        "no convolution weights"),
    "no_tensors": (lambda d: raw_safetensors(d / "none.safetensors", {"__metadata__": {"a": "b"}}),
                   "holds no tensors"),
    "dtype_is_a_list": (lambda d: raw_safetensors(
        d / "dl.safetensors", {"c.weight": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "unknown dtype"),
    "dtype_is_an_object": (lambda d: raw_safetensors(
        d / "do.safetensors", {"c.weight": {"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "unknown dtype"),
    "deeply_nested_json": (lambda d: raw_safetensors(d / "deep.safetensors", b"[" * 100000 + b"]" * 100000),
                           "nested too deeply"),
    "header_length_over_the_format_limit": (lambda d: _sparse_with_header_length(d / "sparse.safetensors", 1 << 30),
                                            "limit"),
    "pickle_refused": (lambda d: torch.save({"conv.weight": torch.randn(2, 2, 3, 3)}, d / "vae.ckpt")
                       or d / "vae.ckpt", "pickle"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_one_line_exit_2(case, tmp_path, capsys):
    make, needle = BAD_INPUTS[case]
    path = make(tmp_path)
    before = _fingerprint(path)
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert str(path) in lines[0] and needle in lines[0], lines[0]
    assert _fingerprint(path) == before


def test_pickle_allowed_loads_weights_only(tmp_path, capsys):
    path = tmp_path / "vae.pth"
    torch.save({"state_dict": {"conv.weight": torch.randn(4, 3, 3, 3)}}, path)
    code, out, err = run_cli(["verify", str(path), "--allow-pickle", "--size", "8"], capsys)
    assert code == 0, err
    assert "conv2d_igemm" in out and "not recognised" in out


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-pickle",))


def test_malicious_pickle_never_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"conv.weight": _Evil()}))
    code, out, err = run_cli(["verify", str(path), "--allow-pickle"], capsys)
    assert code == 2 and "weights-only pickle" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "pwned-by-pickle").exists()


def test_refused_pickle_is_one_whole_line(tmp_path, capsys):
    """torch's weights-only refusal is many lines with terminal colour codes;
    the error names the refused class in one whole line, cut nowhere."""
    path = tmp_path / "model.pt"
    torch.save({"model": torch.nn.Conv2d(3, 4, 3)}, path)
    code, out, err = run_cli(["verify", str(path), "--allow-pickle"], capsys)
    line = err.strip()
    assert code == 2 and len(line.splitlines()) == 1 and "\x1b" not in line
    assert "torch.nn.modules.conv.Conv2d" in line
    assert line.endswith("convert it to safetensors where you trust its code")


def test_long_error_detail_is_cut_at_a_word():
    from conv_patch.tools.checkpoint import _detail
    text = _detail(RuntimeError("\x1b[1mbold\x1b[0m " + "word " * 60 + "\nsecond line"))
    assert text.startswith("RuntimeError: bold word") and text.endswith("word ...")
    assert "\x1b" not in text and "second" not in text and len(text) < 200


def test_nan_weights_are_a_finding_not_a_crash(tmp_path, capsys):
    w = torch.randn(4, 3, 3, 3)
    w[0, 0, 0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file({"bad.weight": w, "good.weight": torch.randn(4, 3, 3, 3)}, str(path))
    code, out, err = run_cli(["verify", str(path), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, err
    assert "finding: 1 conv weight(s) contain NaN/Inf (bad)" in out
    layers = json.loads((tmp_path / "r.json").read_text())["reports"][0]["layers"]
    assert [r["note"] for r in layers if r["name"] == "bad"] == ["weights contain NaN/Inf: not compared"]


def test_unknown_architecture_per_layer_only(tmp_path, capsys):
    path = tmp_path / "misc.safetensors"
    save_file({"a.weight": torch.randn(5, 3, 3, 3), "a.bias": torch.randn(5), "b.weight": torch.randn(7, 5, 1, 1),
               "c.weight": torch.randn(6, 7, 5, 5).half()}, str(path))
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 0, err
    assert "architecture not recognised: per-layer checks only" in out
    assert all(n in out for n in ("5->7 k1x1", "7->6 k5x5", "3->5 k3x3")) and "end to end" not in out


def test_mismatch_exits_1(tmp_path, capsys, monkeypatch):
    path = _good_file(tmp_path)
    from conv_patch.ops import conv2d as conv
    real = conv2d_op.run_kernel
    monkeypatch.setattr(conv2d_op, "run_kernel", lambda *a, **k: real(*a, **k) + 0.5)  # the functional API's
    monkeypatch.setattr(conv, "run_kernel", lambda *a, **k: real(*a, **k) + 0.5)  # the dispatch core's
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 1 and "FAIL" in out


# -- recognised formats ----------------------------------------------------------

def _small_kl():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1, norm_num_groups=32)


def diffusers_to_ldm(sd):
    """The original single-file key layout, written from diffusers keys (the
    inverse of diffusers' own converter), for building ldm-format test files."""
    n_up = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("decoder.up_blocks."))
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if parts[1] == "down_blocks":
            k = f"{parts[0]}.down.{parts[2]}." + ".".join(parts[3:])
            k = k.replace(".resnets.", ".block.").replace(".downsamplers.0.", ".downsample.")
        elif parts[1] == "up_blocks":
            k = f"{parts[0]}.up.{n_up - 1 - int(parts[2])}." + ".".join(parts[3:])
            k = k.replace(".resnets.", ".block.").replace(".upsamplers.0.", ".upsample.")
        elif parts[1] == "mid_block":
            k = k.replace("mid_block.resnets.0.", "mid.block_1.").replace("mid_block.resnets.1.", "mid.block_2.")
            k = (k.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
                 .replace("to_q", "q").replace("to_k", "k").replace("to_v", "v").replace("to_out.0", "proj_out"))
            if ".attn_1." in k and k.endswith("weight") and v.dim() == 2:
                v = v[:, :, None, None]
        k = k.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        out[k] = v.contiguous()
    return out


def _decode_ref(vae, latent_hw=4):
    torch.manual_seed(1)
    with torch.no_grad():
        return vae.decode(torch.randn(1, 4, latent_hw, latent_hw)).sample


@pytest.mark.parametrize("layout", ["diffusers", "ldm", "ldm_full_checkpoint", "diffusers_decoder_only",
                                    "ldm_decoder_only"])
def test_autoencoder_kl_layouts(layout, tmp_path, capsys):
    vae = _small_kl()
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    decoder_only = layout.endswith("decoder_only")
    if decoder_only:
        sd = {k: v for k, v in sd.items() if not k.startswith(("encoder.", "quant_conv."))}
    if layout.startswith("ldm"):
        sd = diffusers_to_ldm(sd)
    if layout == "ldm_full_checkpoint":
        sd = {f"first_stage_model.{k}": v for k, v in sd.items()}
        sd["model.diffusion_model.input_blocks.0.0.weight"] = torch.randn(8, 4, 3, 3)
    path = tmp_path / f"{layout}.safetensors"
    save_file(sd, str(path))
    from conv_patch.tools import checkpoint, formats
    state = checkpoint.load(path)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
    assert fmt.kind == ("diffusers-autoencoderkl" if layout.startswith("diffusers") else "ldm-vae")
    if layout == "ldm_full_checkpoint":
        state = {k[len("first_stage_model."):]: v for k, v in state.items() if k.startswith("first_stage_model.")}
    rebuilt = fmt.build(state).eval()
    assert torch.equal(_decode_ref(rebuilt), _decode_ref(vae))  # the same model, recovered from shapes
    if layout in ("ldm", "diffusers_decoder_only"):
        return  # the CLI's run (15-30 s under the interpreter) is the same as another layout's
    code, out, err = run_cli(["verify", str(path), "--size", "16", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert "block_out_channels=[32, 64]" in report["model"]
    assert [e["what"] for e in report["end_to_end"]] == ["decode 16x16"] + ([] if decoder_only else ["encode 16x16"])
    down = [r for r in report["layers"] if "down" in r["name"] and "sample" in r["name"]]
    assert all("s2x2" in r["shape"] for r in down) and (decoder_only or down)


def test_autoencoder_tiny_file(tmp_path, capsys):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderTiny(encoder_block_out_channels=(16,) * 4, decoder_block_out_channels=(16,) * 4,
                                    num_encoder_blocks=(1, 2, 1, 1), num_decoder_blocks=(1, 1, 2, 1),
                                    latent_channels=4)
    path = tmp_path / "tiny.safetensors"
    save_file(vae.state_dict(), str(path))
    code, out, err = run_cli(["verify", str(path), "--size", "16"], capsys)
    assert code == 0, out + err
    assert "AutoencoderTiny: 4 latent channels, encoder blocks [1, 2, 1, 1], decoder blocks [1, 1, 2, 1]" in out
    assert "encoder.layers.2" in out and "s2x2" in out  # the stride-2 downsampler found from the missing bias


def test_taesd_format_own_module(tmp_path, capsys):
    path = tmp_path / "taesd_decoder.safetensors"
    save_file(taesd.seeded_(taesd.decoder(4, 16, pool=False)).state_dict(), str(path))
    code, out, err = run_cli(["verify", str(path), "--size", "16"], capsys)
    assert code == 0, out + err
    assert "TAESD-format decoder: 4 latent channels, 16 wide, 10 blocks" in out and "decode 16x16" in out


@pytest.mark.skipif(not HAVE_TAEF2, reason="../shared/models not present")
def test_taef2_pair_reconstructs_real_photo(tmp_path, capsys, device):
    enc, dec = SHARED / "models" / "taef2_encoder.safetensors", SHARED / "models" / "taef2_decoder.safetensors"
    before = [_fingerprint(enc), _fingerprint(dec)]
    # On the CPU 32x32 (the interpreter's time; 64x64 took 2 minutes of CI):
    # a 4x4 latent reconstructs the photo at 19 dB. The 64x64 round trip
    # above 20 dB is test_models.test_taef2_real_weights_on_real_photo's.
    size = "32" if device.type == "cpu" else "512"
    code, out, err = run_cli(["verify", str(enc), str(dec), "--image", str(SHARED / "images" / "astronaut.png"),
                              "--size", size, "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    assert [_fingerprint(enc), _fingerprint(dec)] == before
    reports = json.loads((tmp_path / "r.json").read_text())["reports"]
    recon = [e for r in reports for e in r["end_to_end"] if e["image_psnr_patched_db"] is not None]
    assert len(recon) == 1
    p, u = recon[0]["image_psnr_patched_db"], recon[0]["image_psnr_unpatched_db"]
    assert abs(p - u) < 0.1 and u > (17 if device.type == "cpu" else 29)


def test_recognised_but_unbuildable_falls_back_to_per_layer(tmp_path, capsys):
    """Keys of a TAESD decoder whose block widths do not chain: no crash."""
    sd = taesd.seeded_(taesd.decoder(4, 16, pool=False)).state_dict()
    sd["3.conv.0.weight"] = torch.randn(16, 9, 3, 3)
    path = tmp_path / "odd.safetensors"
    save_file(sd, str(path))
    code, out, err = run_cli(["verify", str(path), "--size", "16"], capsys)
    assert code == 0, out + err
    assert "looks like taesd-decoder but the model could not be built" in out and "end to end" not in out


def test_image_without_encoder_is_explained(tmp_path, capsys):
    path = tmp_path / "d.safetensors"
    save_file(taesd.seeded_(taesd.decoder(4, 16, pool=False)).state_dict(), str(path))
    img = tmp_path / "x.png"
    from PIL import Image
    Image.new("RGB", (20, 20), (10, 200, 30)).save(img)
    code, out, err = run_cli(["verify", str(path), "--image", str(img), "--size", "16"], capsys)
    assert code == 0 and "--image needs an encoder and a decoder" in out
    code, out, err = run_cli(["verify", str(path), "--image", str(tmp_path / "none.png")], capsys)
    assert code == 2 and "none.png: no such image file" in err


def test_json_report_never_overwrites_an_input(tmp_path, capsys):
    path = _good_file(tmp_path)
    before = _fingerprint(path)
    code, out, err = run_cli(["verify", str(path), "--json", str(path)], capsys)
    assert code == 2 and "overwrite" in err and len(err.strip().splitlines()) == 1
    assert _fingerprint(path) == before


def test_format_detection_is_linear_in_the_tensors(tmp_path, capsys):
    """A tiny file naming tensor 1000000000000.bias: recognising its format
    must not walk a trillion layer indices (it did, for minutes)."""
    import signal

    from conv_patch.tools import formats
    shapes = {"0.weight": (4, 3, 3, 3), "1000000000000.bias": (4,)}

    def too_slow(*a):
        raise TimeoutError("format detection did not finish in 20 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(20)
    try:
        assert formats.taesd_plan(shapes) is None
        path = tmp_path / "far.safetensors"
        save_file({"0.weight": torch.randn(4, 3, 3, 3), "1000000000000.bias": torch.randn(4)}, str(path))
        code, out, err = run_cli(["verify", str(path), "--size", "8"], capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert code == 0 and "not recognised" in out, (out, err)


def test_names_from_the_file_are_text_not_markup(tmp_path):
    """A tensor named like rich markup, in a file named like it: the table
    shows both as they are (it crashed, or dropped the bracket)."""
    pytest.importorskip("rich")
    from rich.console import Console

    from conv_patch.tools import verify
    path = tmp_path / "vae [fp16].safetensors"
    save_file({"[/x].weight": torch.randn(4, 3, 3, 3), "[bold]b.weight": torch.randn(4, 4, 1, 1)}, str(path))
    reports = verify.verify_files([str(path)], torch.device("cpu"), None, 8)
    console = Console(record=True, width=200, force_terminal=True)
    for r in reports:
        r.model = path.name  # as a file's report is titled (the name alone: a long tmp path wraps the title)
        cli.render_rich(r, console)
    text = console.export_text()
    # Layers are shown by module path (the ".weight" dropped).
    assert "│ [/x] " in text and "│ [bold]b " in text and "vae [fp16].safetensors" in text


def test_narrow_kernels_and_layer_order(tmp_path, capsys):
    """A 1x31 weight is probed with an input wide enough for it (it was a
    RuntimeError traceback), and layers are listed in natural order."""
    path = tmp_path / "odd.safetensors"
    save_file({"10.weight": torch.randn(4, 4, 3, 3), "2.weight": torch.randn(4, 4, 1, 31),
               "1.weight": torch.randn(4, 3, 3, 3)}, str(path))
    code, out, err = run_cli(["verify", str(path), "--size", "8"], capsys)
    assert code == 0 and "Traceback" not in err, (out, err)
    assert "4->4 k1x31" in out
    layers = [line.split()[0] for line in out.splitlines() if "->" in line]
    assert layers == ["1", "2", "10"]


def test_unreadable_image_is_refused_before_any_check(tmp_path, capsys, monkeypatch):
    path = _good_file(tmp_path)
    img = _write(tmp_path / "photo.png", "this is not a png\n")
    from conv_patch.tools import verify
    checked = []
    monkeypatch.setattr(verify, "check_file_layers", lambda *a, **k: checked.append(1) or [])
    code, out, err = run_cli(["verify", str(path), "--image", str(img)], capsys)
    assert code == 2 and "photo.png: cannot read as an image" in err and len(err.strip().splitlines()) == 1
    assert not checked


# -- Wan 2.1-family video VAE ----------------------------------------------------

WAN_TINY = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True])


def _small_wan():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(**WAN_TINY)


def diffusers_to_wan_original(sd, num_res_blocks):
    """The original Wan repository's key layout (wan/modules/vae.py, as in
    Wan2.1_VAE.pth and ComfyUI's wan_2.1_vae.safetensors), written from
    AutoencoderKLWan keys for building test files; independent of
    conv_patch.tools.formats' own mapping, which goes the other way."""
    per_level = num_res_blocks + 2  # the decoder's resnets, then its resample
    inner = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
             "conv_shortcut": "shortcut"}
    out = {}
    for k, v in sd.items():
        p = k.split(".")
        resnet = ".resnets." in k or ".down_blocks." in k
        if p[0] == "quant_conv":
            p = ["conv1"] + p[1:]
        elif p[0] == "post_quant_conv":
            p = ["conv2"] + p[1:]
        elif p[1] == "conv_in":
            p = [p[0], "conv1"] + p[2:]
        elif p[1] == "norm_out":
            p = [p[0], "head", "0"] + p[2:]
        elif p[1] == "conv_out":
            p = [p[0], "head", "2"] + p[2:]
        elif p[1] == "mid_block":
            idx = {("resnets", "0"): "0", ("attentions", "0"): "1", ("resnets", "1"): "2"}[(p[2], p[3])]
            p = [p[0], "middle", idx] + p[4:]
        elif p[1] == "down_blocks":
            p = ["encoder", "downsamples"] + p[2:]
        elif p[1] == "up_blocks":
            level = int(p[2])
            if p[3] == "resnets":
                p = ["decoder", "upsamples", str(level * per_level + int(p[4]))] + p[5:]
            else:  # upsamplers.0
                p = ["decoder", "upsamples", str(level * per_level + per_level - 1)] + p[5:]
        if resnet and p[-2] in inner:
            p = p[:-2] + inner[p[-2]].split(".") + p[-1:]
        out[".".join(p)] = v.contiguous()
    return out


def _wan_file(tmp_path, layout, sd=None):
    sd = sd if sd is not None else {k: v.contiguous() for k, v in _small_wan().state_dict().items()}
    if layout == "original":
        sd = diffusers_to_wan_original(sd, WAN_TINY["num_res_blocks"])
    path = tmp_path / f"wan_{layout}.safetensors"
    save_file(sd, str(path))
    return path


def _wan_decode_ref(vae):
    torch.manual_seed(1)
    with torch.no_grad():
        return vae.decode(torch.randn(1, 4, 2, 2, 2)).sample


def test_wan_original_mapping_names_the_real_modules():
    """The test's own mapping gives the original module's names (not just
    something the package's inverse accepts)."""
    names = set(diffusers_to_wan_original({k: torch.zeros(1) for k in _small_wan().state_dict()}, 1))
    for k in ("encoder.conv1.weight", "encoder.downsamples.0.residual.0.gamma",
              "encoder.downsamples.1.resample.1.weight", "encoder.downsamples.3.time_conv.weight", "encoder.middle.1.to_qkv.weight", "encoder.head.2.weight",
              "conv1.weight", "conv2.bias", "decoder.conv1.weight", "decoder.middle.2.residual.6.weight",
              "decoder.upsamples.2.time_conv.weight", "decoder.upsamples.3.shortcut.weight",
              "decoder.upsamples.5.resample.1.weight", "decoder.upsamples.7.residual.6.bias", "decoder.head.0.gamma"):
        assert k in names, k
    assert not any("up_blocks" in k or "down_blocks" in k or "mid_block" in k for k in names)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_wan_video_vae_layouts(layout, tmp_path, capsys):
    vae = _small_wan()
    path = _wan_file(tmp_path, layout, {k: v.contiguous() for k, v in vae.state_dict().items()})
    before = _fingerprint(path)
    from conv_patch.tools import checkpoint, formats
    state = checkpoint.load(path)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
    assert fmt.kind == "wan-vae" and not fmt.problem, fmt.description
    assert ("original Wan layout" if layout == "original" else "diffusers layout") in fmt.description
    assert ("base_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, z_dim=4, temperal_downsample=[False, True]"
            in fmt.description)
    rebuilt = fmt.build(state).eval()
    assert {k: v for k, v in rebuilt.config.items() if k in WAN_TINY} == WAN_TINY
    assert torch.equal(_wan_decode_ref(rebuilt), _wan_decode_ref(vae))  # the same model, recovered from shapes
    code, out, err = run_cli(["verify", str(path), "--size", "16", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    assert _fingerprint(path) == before
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert [e["what"] for e in report["end_to_end"]] == ["decode 2 latent frames to 16x16",
                                                         "encode 5 frames of 16x16"]
    assert all(e["passed"] for e in report["end_to_end"])
    layers = {r["name"]: r for r in report["layers"]}
    assert all(r["passed"] and r["rel_err"] is not None for r in layers.values())
    enc = "encoder.conv1" if layout == "original" else "encoder.conv_in"
    assert layers[enc]["shape"] == "3->4 k3x3x3 s1x1x1 p2/0x1x1" and layers[enc]["route"] == "conv3d_igemm"
    time_down = "encoder.downsamples.3.time_conv" if layout == "original" else "encoder.down_blocks.3.time_conv"
    assert layers[time_down]["shape"] == "8->8 k3x1x1 s2x1x1 p0x0x0"
    down = "encoder.downsamples.1.resample.1" if layout == "original" else "encoder.down_blocks.1.resample.1"
    assert "s2x2 p0x0" in layers[down]["shape"]
    assert any("Conv3d weights: 10 checked, one per distinct shape" in n for n in report["notes"])


def test_wan_per_layer_check_catches_a_wrong_conv3d(tmp_path, capsys, monkeypatch):
    path = _wan_file(tmp_path, "diffusers")
    real = functional.conv3d
    monkeypatch.setattr(functional, "conv3d", lambda *a, **k: real(*a, **k) * 1.01)
    code, out, err = run_cli(["verify", str(path), "--size", "16"], capsys)
    assert code == 1 and "FAIL" in out
    assert all("FAIL" in line for line in out.splitlines() if "k3x3x3" in line)


def test_wan_image_is_one_frame(tmp_path, capsys):
    path = _wan_file(tmp_path, "original")
    img = tmp_path / "x.png"
    from PIL import Image
    Image.new("RGB", (20, 20), (10, 200, 30)).save(img)
    code, out, err = run_cli(["verify", str(path), "--image", str(img), "--size", "16"], capsys)
    assert code == 0, out + err
    assert f"encode->decode {img} as one frame at 16x16" in out and "reconstruction PSNR" in out


def _wan_bad(tmp_path, change):
    sd = {k: v.contiguous() for k, v in _small_wan().state_dict().items()}
    change(sd)
    return _wan_file(tmp_path, "original", sd)


WAN_BAD = {
    "missing_tensor": (lambda sd: sd.pop("decoder.up_blocks.1.resnets.1.conv2.weight"),
                       "tensor 'decoder.upsamples.4.residual.6.weight' of AutoencoderKLWan base_dim=4"),
    "misshaped_tensor": (lambda sd: sd.__setitem__("encoder.mid_block.resnets.0.conv1.weight",
                                                   torch.randn(8, 8, 3, 1, 3)),
                         "tensor 'encoder.middle.0.residual.2.weight' has shape [8, 8, 3, 1, 3]"),
    "missing_config_tensor": (lambda sd: sd.pop("decoder.up_blocks.1.resnets.0.conv2.weight"),
                              "tensor 'decoder.upsamples.3.residual.6.weight' is missing"),
    "extra_tensor": (lambda sd: sd.__setitem__("decoder.extra.weight", torch.randn(2, 2, 1, 1, 1)),
                     "tensor 'decoder.extra.weight' is not part of AutoencoderKLWan"),
    "missing_gamma_no_sibling": (lambda sd: sd.pop("encoder.norm_out.gamma"),
                                 "tensor 'encoder.norm_out.gamma' (AutoencoderKLWan's name) of AutoencoderKLWan"),
}


@pytest.mark.parametrize("case", sorted(WAN_BAD))
def test_wan_bad_file_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    change, needle = WAN_BAD[case]
    path = _wan_bad(tmp_path, change)
    before = _fingerprint(path)
    from conv_patch.tools import verify
    checked = []
    monkeypatch.setattr(verify, "check_file_layers", lambda *a, **k: checked.append(1) or [])
    code, out, err = run_cli(["verify", str(path)], capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert str(path) in lines[0] and "looks like a Wan video VAE, original Wan layout" in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert _fingerprint(path) == before and not checked


def test_wan_truncated_and_absurd_files(tmp_path, capsys):
    good = _wan_file(tmp_path, "original")
    cut = _write(tmp_path / "cut.safetensors", good.read_bytes()[:-64])
    absurd = raw_safetensors(tmp_path / "absurd.safetensors", {"encoder.conv1.weight": {
        "dtype": "BF16", "shape": [2**40, 2**40, 3, 3, 3], "data_offsets": [0, 2**85]}}, bytes(64))
    for path, needle in ((cut, "truncated file"), (absurd, "runs past the end")):
        before = _fingerprint(path)
        code, out, err = run_cli(["verify", str(path)], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (out, err)
        assert str(path) in lines[0] and needle in lines[0], lines[0]
        assert _fingerprint(path) == before


WAN22_TINY = dict(base_dim=4, decoder_base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                  temperal_downsample=[False, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                  scale_factor_spatial=8, scale_factor_temporal=2)


def _small_wan22():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(**WAN22_TINY)


def diffusers_to_wan22_original(sd, num_res_blocks):
    """The original Wan 2.2 layout (wan/modules/vae2_2.py, as in
    Wan2.2_VAE.pth and ComfyUI's wan2.2_vae.safetensors) from
    AutoencoderKLWan(is_residual=True) keys: each level's residual blocks
    then its resample nested as ``downsamples.L.downsamples.J`` /
    ``upsamples.L.upsamples.J``; the rest as in Wan 2.1."""
    inner = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
             "conv_shortcut": "shortcut"}
    nested, rest = {}, {}
    for k, v in sd.items():
        p = k.split(".")
        if len(p) > 3 and p[1] in ("down_blocks", "up_blocks"):
            half, outer = ("encoder", "downsamples") if p[1] == "down_blocks" else ("decoder", "upsamples")
            if p[3] == "resnets":
                tail = p[5:]
                if tail[0] in inner:
                    tail = inner[tail[0]].split(".") + tail[1:]
                p = [half, outer, p[2], outer, p[4]] + tail
            else:  # the level's downsampler / upsampler, after its residual blocks
                j = num_res_blocks if half == "encoder" else num_res_blocks + 1
                p = [half, outer, p[2], outer, str(j)] + p[4:]
            nested[".".join(p)] = v.contiguous()
        else:
            rest[k] = v
    out = diffusers_to_wan_original(rest, num_res_blocks)
    out.update(nested)
    return out


def _wan22_file(tmp_path, layout, sd):
    if layout == "original":
        sd = diffusers_to_wan22_original(sd, WAN22_TINY["num_res_blocks"])
    path = tmp_path / f"wan22_{layout}.safetensors"
    save_file(sd, str(path))
    return path


def test_wan22_original_mapping_names_the_real_modules():
    names = set(diffusers_to_wan22_original({k: torch.zeros(1) for k in _small_wan22().state_dict()}, 1))
    for k in ("conv1.weight", "conv2.weight", "encoder.conv1.weight", "decoder.conv1.weight",
              "encoder.downsamples.0.downsamples.0.residual.0.gamma", "encoder.downsamples.0.downsamples.1.resample.1.weight",
              "encoder.downsamples.1.downsamples.0.shortcut.weight", "encoder.downsamples.1.downsamples.1.time_conv.weight",
              "decoder.upsamples.0.upsamples.2.time_conv.weight", "decoder.upsamples.1.upsamples.2.resample.1.bias",
              "decoder.upsamples.2.upsamples.1.residual.6.weight", "decoder.middle.1.to_qkv.weight",
              "decoder.head.0.gamma", "decoder.head.2.weight"):
        assert k in names, k
    assert not any("up_blocks" in k or "down_blocks" in k or "mid_block" in k for k in names)


@pytest.mark.parametrize("layout", ["diffusers", "original"])
def test_wan22_video_vae_layouts(layout, tmp_path, capsys):
    """A Wan 2.2-style VAE (the TI2V-5B layout: residual up/down blocks,
    2x2 patches) in either layout: recognised from names and shapes, rebuilt
    as the same model, and verified end to end (decode and encode)."""
    vae = _small_wan22()
    path = _wan22_file(tmp_path, layout, {k: v.contiguous() for k, v in vae.state_dict().items()})
    before = _fingerprint(path)
    from conv_patch.tools import checkpoint, formats
    state = checkpoint.load(path)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
    assert fmt.kind == "wan-vae" and not fmt.problem, (fmt.description, fmt.problem)
    assert "is_residual=True, patch_size=2 (Wan 2.2)" in fmt.description and fmt.factor == 8
    rebuilt = fmt.build(state).eval()
    assert {k: v for k, v in rebuilt.config.items() if k in WAN22_TINY} == WAN22_TINY
    torch.manual_seed(1)
    z = torch.randn(1, 4, 2, 2, 2)
    with torch.no_grad():
        assert torch.equal(rebuilt.decode(z).sample, vae.decode(z).sample)
    code, out, err = run_cli(["verify", str(path), "--size", "16", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    assert _fingerprint(path) == before
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert [e["what"] for e in report["end_to_end"]] == ["decode 2 latent frames to 16x16",
                                                         "encode 5 frames of 16x16"]
    assert all(e["passed"] for e in report["end_to_end"]), report["end_to_end"]


def test_wan22_file_with_a_wrong_tensor_is_one_line_exit_2(tmp_path, capsys):
    """A plainly Wan 2.2 file whose tensor does not fit the model its other
    tensors describe: one line naming the file and the tensor, exit 2."""
    sd = {k: v.contiguous() for k, v in _small_wan22().state_dict().items()}
    sd["decoder.up_blocks.1.resnets.0.conv1.weight"] = torch.randn(8, 16, 3, 3, 1)
    path = _wan22_file(tmp_path, "original", sd)
    code, out, err = run_cli(["verify", str(path), "--size", "16"], capsys)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (out, err)
    assert str(path) in lines[0] and "decoder.upsamples.1.upsamples.0.residual.2.weight" in lines[0], lines[0]


def test_conv3d_probe_is_bounded(tmp_path, capsys):
    """A real but absurdly shaped 5-D weight (a million input channels of
    1x1x1) is not probed with a gigabyte input: a note, not a stall."""
    path = tmp_path / "wide.safetensors"
    save_file({"a.weight": torch.randn(1, 1 << 20, 1, 1, 1), "b.weight": torch.randn(4, 3, 3, 3, 3)}, str(path))
    code, out, err = run_cli(["verify", str(path), "--size", "8", "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    layers = {r["name"]: r for r in json.loads((tmp_path / "r.json").read_text())["reports"][0]["layers"]}
    assert layers["a"]["note"] == "too large for a per-layer check here: not compared"
    assert layers["b"]["rel_err"] is not None and layers["b"]["shape"] == "3->4 k3x3x3 s1x1x1 p1x1x1"


def test_wan_original_pth_is_recognised_with_allow_pickle(tmp_path):
    """Wan2.1_VAE.pth is a pickle of the original layout: with allow_pickle
    (weights only) it is read and recognised like the safetensors file."""
    from conv_patch.tools import checkpoint, formats
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save(diffusers_to_wan_original(_small_wan().state_dict(), WAN_TINY["num_res_blocks"]), path)
    state = checkpoint.load(path, allow_pickle=True)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
    assert fmt.kind == "wan-vae" and "original Wan layout" in fmt.description and not fmt.problem


def test_wan_original_mapping_agrees_with_diffusers_converter():
    """At the released Wan 2.1 config (which diffusers' single-file
    converter is written for), the test's mapping and conv_patch's pair
    every tensor as diffusers' own converter does."""
    diffusers = pytest.importorskip("diffusers")
    convert = pytest.importorskip("diffusers.loaders.single_file_utils").convert_wan_vae_to_diffusers
    from conv_patch.tools import formats
    with torch.device("meta"):
        names = list(diffusers.AutoencoderKLWan().state_dict())
    sd = {k: torch.tensor([float(i)]) for i, k in enumerate(names)}
    orig = diffusers_to_wan_original(sd, 2)
    theirs = convert(dict(orig))
    assert all(theirs[k].item() == v.item() for k, v in sd.items())
    ours = formats.wan_original_names(list(orig))
    assert all(theirs[ours[k]].item() == v.item() for k, v in orig.items())


def test_wan_decoder_only_file(tmp_path):
    """A file with the decoder half alone (decoder.*, post_quant_conv) is a
    decoder; a tensor missing from that half is still a problem."""
    from conv_patch.tools import formats
    vae = _small_wan()
    sd = {k: v for k, v in vae.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    fmt = formats.recognise({k: tuple(v.shape) for k, v in sd.items()})
    assert fmt.kind == "wan-vae" and not fmt.problem and fmt.encode is None and fmt.decode is not None
    assert fmt.description.endswith("(decoder only)") and "dim_mult=[1, 2, 2], num_res_blocks=1" in fmt.description
    assert torch.equal(_wan_decode_ref(fmt.build(sd).eval()), _wan_decode_ref(vae))
    del sd["decoder.conv_out.bias"]
    with pytest.raises(ValueError, match="1 missing"):  # the load is strict on the half it holds
        fmt.build(sd)
    fmt = formats.recognise({k: tuple(v.shape) for k, v in sd.items()})
    assert "tensor 'decoder.conv_out.bias' of AutoencoderKLWan" in fmt.problem and "is missing" in fmt.problem


def test_a_wide_conv3d_is_probed_smaller_not_skipped(monkeypatch):
    """A 5-D weight whose probe at the requested size exceeds the bounds is
    compared on a smaller one (a full Wan 2.2 VAE's 1024-channel convs on the
    GPU); only one that no size fits is left out, with its note."""
    from conv_patch.tools import verify
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 4, 3, 3, 3, generator=g) * 0.2, torch.randn(4, generator=g)
    pads = ((2, 0), (1, 1), (1, 1))
    monkeypatch.setattr(verify, "CONV3D_MAX_PROBE", 1000)  # 4 x 3 x 16 x 16 inputs do not fit, 8 x 8 do
    r = verify.check_layer3d("w", w, b, (1, 1, 1), pads, 3, 16, 0)
    assert r.rel_err is not None and r.passed and r.note in (None, ""), r
    monkeypatch.setattr(verify, "CONV3D_MAX_PROBE", 10)
    r = verify.check_layer3d("w", w, b, (1, 1, 1), pads, 3, 16, 0)
    assert r.rel_err is None and r.note == "too large for a per-layer check here: not compared"


# Tiny stand-ins for the released configurations (formats.VIDEO_DEFAULTS):
# the recogniser matches a file against the class built with them.
VIDEO_TINY = {
    "AutoencoderKLCogVideoX": (16, dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, norm_num_groups=4,
                                        layers_per_block=1)),
    # Mochi's resnets only in its outermost blocks (the first and last,
    # where the clip has most and fewest frames): every GroupNorm there is
    # 32 groups per frame under the interpreter. The four down and up blocks
    # (their temporal and spatial resampling) and the resnet tensors stay in
    # the file the recogniser matches; 32 channels is Mochi's group count.
    "AutoencoderKLMochi": (16, dict(encoder_block_out_channels=(32,) * 4, decoder_block_out_channels=(32,) * 4,
                                    latent_channels=4, layers_per_block=(1, 0, 0, 0, 1))),
    "AutoencoderKLHunyuanVideo": (16, dict(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1,
                                           norm_num_groups=4)),
    "AutoencoderKLLTXVideo": (64, dict(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                       latent_channels=4, layers_per_block=(1,) * 5,
                                       decoder_layers_per_block=(1,) * 5)),
}


@pytest.mark.parametrize("family", sorted(VIDEO_TINY))
def test_other_diffusers_video_vaes_are_recognised_as_released(family, tmp_path, capsys, monkeypatch):
    """A file holding exactly the tensors of a CogVideoX, Mochi, HunyuanVideo
    or LTX-Video VAE (here each built with a tiny configuration standing in
    for the released one) is recognised, built, and verified end to end
    (seeded latent frames decoded, frames encoded); its decoder half alone
    decodes only; one tensor of another shape makes it none of them: the
    per-layer checks alone, said so."""
    diffusers = pytest.importorskip("diffusers")
    from conv_patch.tools import formats
    size, cfg = VIDEO_TINY[family]
    monkeypatch.setattr(formats, "VIDEO_DEFAULTS", tuple(
        (c, label, s, t, cfg if c == family else conf) for c, label, s, t, conf in formats.VIDEO_DEFAULTS))
    torch.manual_seed(0)
    vae = getattr(diffusers, family)(**cfg).eval()
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    fmt = formats.recognise(shapes)
    assert fmt.kind == "diffusers-video-vae" and f"({family})" in fmt.description, fmt.description
    assert fmt.decode and fmt.encode and not fmt.problem
    path = tmp_path / "vae.safetensors"
    save_file(state, str(path))
    before = _fingerprint(path)
    code, out, err = run_cli(["verify", str(path), "--size", str(size), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    assert _fingerprint(path) == before
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert [e["what"].split(" ")[0] for e in report["end_to_end"]] == ["decode", "encode"]
    assert all(e["passed"] for e in report["end_to_end"]) and all(r["passed"] for r in report["layers"])
    half = {k: v for k, v in shapes.items() if not k.startswith(("encoder.", "quant_conv."))}
    fmt = formats.recognise(half)
    assert fmt.decode and not fmt.encode and "(decoder only)" in fmt.description
    wrong = dict(shapes)
    k = next(k for k, v in wrong.items() if k.startswith("decoder.") and len(v) == 5)
    wrong[k] = (wrong[k][0] + 1,) + wrong[k][1:]
    fmt = formats.recognise(wrong)
    assert fmt.kind == "unknown" and "none of the" in fmt.description and "CogVideoX" in fmt.description


# LTX-Video 0.9.0's original names of diffusers' AutoencoderKLLTXVideo
# tensors (the inverse of diffusers' single-file converter, which the test
# checks by running the converter on them): (diffusers prefix, original).
LTX_ORIGINAL = [
    ("decoder.mid_block.", "decoder.up_blocks.0."), ("decoder.up_blocks.0.", "decoder.up_blocks.1."),
    ("decoder.up_blocks.1.upsamplers.0.", "decoder.up_blocks.2."), ("decoder.up_blocks.1.", "decoder.up_blocks.3."),
    ("decoder.up_blocks.2.conv_in.", "decoder.up_blocks.4."), ("decoder.up_blocks.2.upsamplers.0.", "decoder.up_blocks.5."),
    ("decoder.up_blocks.2.", "decoder.up_blocks.6."), ("decoder.up_blocks.3.conv_in.", "decoder.up_blocks.7."),
    ("decoder.up_blocks.3.upsamplers.0.", "decoder.up_blocks.8."), ("decoder.up_blocks.3.", "decoder.up_blocks.9."),
    ("encoder.down_blocks.0.downsamplers.0.", "encoder.down_blocks.1."),
    ("encoder.down_blocks.0.conv_out.", "encoder.down_blocks.2."), ("encoder.down_blocks.0.", "encoder.down_blocks.0."),
    ("encoder.down_blocks.1.downsamplers.0.", "encoder.down_blocks.4."),
    ("encoder.down_blocks.1.conv_out.", "encoder.down_blocks.5."), ("encoder.down_blocks.1.", "encoder.down_blocks.3."),
    ("encoder.down_blocks.2.downsamplers.0.", "encoder.down_blocks.7."), ("encoder.down_blocks.2.", "encoder.down_blocks.6."),
    ("encoder.down_blocks.3.", "encoder.down_blocks.8."), ("encoder.mid_block.", "encoder.down_blocks.9."),
]
LTX_ORIGINAL_PARTS = [(".conv_shortcut.conv.", ".conv_shortcut."), (".resnets.", ".res_blocks."),
                      (".norm3.", ".norm3.norm.")]


def ltx_original_name(name: str) -> str:
    if name in ("latents_mean", "latents_std"):
        return "per_channel_statistics." + {"latents_mean": "mean-of-means", "latents_std": "std-of-means"}[name]
    for new, old in LTX_ORIGINAL:
        if name.startswith(new):
            name = old + name[len(new):]
            break
    for new, old in LTX_ORIGINAL_PARTS:
        name = name.replace(new, old)
    return name


@pytest.mark.parametrize("prefix", ["", "vae."])
def test_ltx_video_original_layout_is_recognised(prefix, tmp_path, capsys, monkeypatch):
    """An LTX-Video VAE in its original layout (the VAE alone, as ComfyUI
    loads it, or under ``vae.`` beside other tensors in a whole checkpoint)
    is read through diffusers' own converter, recognised as released, and
    verified end to end; its names are shown as the file's."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers
    from conv_patch.tools import formats
    family = "AutoencoderKLLTXVideo"
    size, cfg = VIDEO_TINY[family]
    monkeypatch.setattr(formats, "VIDEO_DEFAULTS", tuple(
        (c, label, s, t, cfg if c == family else conf) for c, label, s, t, conf in formats.VIDEO_DEFAULTS))
    torch.manual_seed(0)
    vae = getattr(diffusers, family)(**cfg).eval()
    state = {prefix + ltx_original_name(k): v.contiguous() for k, v in vae.state_dict().items()}
    # The names above are the original ones: diffusers' converter gives the class's back.
    back = convert_ltx_vae_checkpoint_to_diffusers({("" if prefix else "vae.") + k: v for k, v in state.items()})
    assert set(back) == set(vae.state_dict()), sorted(set(back) ^ set(vae.state_dict()))[:6]
    if prefix:
        state["model.diffusion_model.proj_out.weight"] = torch.randn(8, 4)  # a transformer's tensor beside it
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    fmt = formats.recognise(shapes)
    assert fmt.kind == "original-video-vae" and "LTX-Video" in fmt.description and "original layout" in fmt.description
    assert fmt.decode and fmt.encode and not fmt.problem
    path = tmp_path / "ltxv.safetensors"
    save_file(state, str(path))
    code, out, err = run_cli(["verify", str(path), "--size", str(size), "--json", str(tmp_path / "r.json")], capsys)
    assert code == 0, out + err
    report = json.loads((tmp_path / "r.json").read_text())["reports"][0]
    assert [e["what"].split(" ")[0] for e in report["end_to_end"]] == ["decode", "encode"]
    assert all(e["passed"] for e in report["end_to_end"]) and all(r["passed"] for r in report["layers"])
    assert any(".res_blocks." in r["name"] for r in report["layers"])  # the file's own names
    # A decoder alone in the original layout: diffusers' converter reads the encoder, so it is not read.
    half = {k: v for k, v in shapes.items() if ".encoder." not in "." + k}
    assert formats.ltx_original_names(half) is None


def test_an_fp32_check_is_measured_against_float64(monkeypatch):
    """End to end in fp32, the reference is the unpatched model in float64:
    the unpatched fp32 run has its own rounding error (not 0, as against an
    fp32 reference, where the patched run's rounding would be all the bound
    allows); a model that cannot run in float64 gets the fp32 reference, and
    is left in fp32 either way."""
    from conv_patch.tools import verify
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(16, 5, 3))
    x = torch.randn(2, 3, 9, 11) * 3 + 1

    def run(m, t):
        return m(t)
    e = verify.check_end_to_end("decode", net, run, x, torch.float32)
    assert e.passed and 0 < e.rel_err_unpatched < 1e-5 and e.bound > verify.E2E_FLOOR[torch.float32]
    assert next(net.parameters()).dtype == torch.float32

    def fp32_only(m, t):
        if t.dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return m(t)
    net2 = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    e = verify.check_end_to_end("decode", net2, fp32_only, x, torch.float32)
    assert e.rel_err_unpatched == 0 and e.passed and next(net2.parameters()).dtype == torch.float32
