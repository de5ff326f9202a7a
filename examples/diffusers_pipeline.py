"""Run a whole diffusers pipeline with every convolution patched.

    python examples/diffusers_pipeline.py                          # tiny built-in DDPM pipeline, no download
    python examples/diffusers_pipeline.py --model-dir PATH --prompt "an astronaut"   # a local pipeline folder

``conv_patch.apply(pipe)`` patches every nn.Module component (UNet or
transformer, VAE, text encoders where they have convolutions). Prints the
patch report, what runs here (without a CUDA GPU a patched model runs its
original PyTorch code), the time of a plain and of a patched run (same seed),
how far the two outputs are apart, and saves the patched image.
"""

import argparse
import inspect
import time

import torch

import conv_patch
from conv_patch.target import target_for, what_runs


def _run(pipe, args, device):
    kw = {"num_inference_steps": args.steps, "output_type": "np",
          "generator": torch.Generator(device="cpu").manual_seed(args.seed)}
    params = inspect.signature(pipe.__call__).parameters
    if "prompt" in params:
        kw["prompt"] = args.prompt
    if "height" in params and args.size:
        kw["height"] = kw["width"] = args.size
    kw = {k: v for k, v in kw.items() if k in params}
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        out = pipe(**kw)
    if device == "cuda":
        torch.cuda.synchronize()
    images = out.images if hasattr(out, "images") else out[0]
    return torch.as_tensor(images).float(), time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="local folder of a diffusers pipeline (model_index.json + components)")
    ap.add_argument("--prompt", default="an astronaut riding a horse", help="for text-to-image pipelines")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", type=int, default=None, help="image size where the pipeline takes one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None)
    ap.add_argument("--out", default=None, help="save the patched image here (PNG)")
    args = ap.parse_args(argv)

    import diffusers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.model_dir:
        pipe = diffusers.DiffusionPipeline.from_pretrained(args.model_dir, torch_dtype=dtype)
    else:
        torch.manual_seed(0)  # random weights, small UNet: shows the mechanics, not a picture
        unet = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                     block_out_channels=(16, 32), norm_num_groups=8,
                                     down_block_types=("DownBlock2D",) * 2, up_block_types=("UpBlock2D",) * 2)
        pipe = diffusers.DDPMPipeline(unet=unet.to(dtype), scheduler=diffusers.DDPMScheduler())
    pipe = pipe.to(device)

    plain, t_plain = _run(pipe, args, device)
    report = conv_patch.apply(pipe)  # the one line
    patched, t_patched = _run(pipe, args, device)
    print(report)
    if not report.here:  # (the report says it itself where this machine runs no kernel)
        print("here:", what_runs(device))
    err = ((patched - plain).norm() / plain.norm().clamp_min(1e-12)).item()
    t = target_for(torch.device(device))
    compiles = " (the first patched run compiles the kernels)" if t.kernels and not t.interpreter else ""
    print(f"plain {t_plain:.2f} s, patched {t_patched:.2f} s{compiles}; relative difference {err:.2e}")
    if args.out:
        from PIL import Image
        img = (patched[0].clamp(0, 1).numpy() * 255).round().astype("uint8")
        Image.fromarray(img).save(args.out)
        print("saved", args.out)
    return err


if __name__ == "__main__":
    main()
