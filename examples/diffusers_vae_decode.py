"""Decode a latent with a diffusers AutoencoderKL, plain and patched.

    python examples/diffusers_vae_decode.py                      # small built-in config, no download
    python examples/diffusers_vae_decode.py --model-dir PATH     # a local diffusers VAE folder

Prints the patch report, what runs here (without a CUDA GPU a patched model
runs its original PyTorch code), and how far the patched decode is from the
plain one.
"""

import argparse

import torch

import conv_patch
from conv_patch.target import what_runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="local folder holding a diffusers AutoencoderKL (config.json + weights)")
    ap.add_argument("--size", type=int, default=None, help="image size (default 512 on a GPU, 64 on the CPU)")
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    args = ap.parse_args(argv)

    from diffusers import AutoencoderKL

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.model_dir:
        vae = AutoencoderKL.from_pretrained(args.model_dir, torch_dtype=dtype)
    else:
        torch.manual_seed(0)  # random weights in a small SD-like layout
        vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4).to(dtype)
    vae = vae.to(device).eval()
    size = args.size or (512 if device == "cuda" else 64)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    z = torch.randn(1, vae.config.latent_channels, size // factor, size // factor, device=device, dtype=dtype)

    with torch.no_grad():
        plain = vae.decode(z).sample
        report = conv_patch.apply(vae)  # the one line
        patched = vae.decode(z).sample
    print(report)
    if not report.here:  # (the report says it itself where this machine runs no kernel)
        print("here:", what_runs(device))
    err = ((patched.float() - plain.float()).norm() / plain.float().norm()).item()
    print(f"decoded {tuple(patched.shape)}; relative difference patched vs plain: {err:.2e}")
    return err


if __name__ == "__main__":
    main()
