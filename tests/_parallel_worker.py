"""One rank of tests/test_parallel.py's torch.distributed runs (gloo, CPU):
``python tests/_parallel_worker.py RANK WORLD PORT OUT`` decodes and encodes
with a tiny ldm VAE (the ComfyUI modules, from stable-diffusion-sdkit: they
import in a third of diffusers' time, which each spawned rank pays) through
conv_patch.parallel and saves what it got to OUT/rank.pt."""

import os
import sys

import torch
import torch.distributed as dist


def tiny_vae():
    """An AutoencoderKL-shaped pair: ``encoder``/``quant_conv``,
    ``post_quant_conv``/``decoder`` (ldm modules, mid-block attention)."""
    from ldm.modules.diffusionmodules.model import Decoder, Encoder
    torch.manual_seed(0)
    cfg = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[], in_channels=3,
               resolution=16, z_channels=4)
    vae = torch.nn.Module()
    vae.encoder, vae.decoder = Encoder(double_z=True, **cfg), Decoder(**cfg)
    vae.quant_conv, vae.post_quant_conv = torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(4, 4, 1)
    return vae.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 4, 7, 9, generator=g), torch.randn(2, 3, 14, 10, generator=g)


def reference(vae, z, x):
    """The single-process decode and encode the ranks must agree with."""
    with torch.no_grad():
        return vae.decoder(vae.post_quant_conv(z)), vae.quant_conv(vae.encoder(x))


def main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from conv_patch import parallel
        vae = tiny_vae()
        z, x = inputs()
        with torch.no_grad():
            y_all, report = parallel.decode(vae, z, gather="all", return_report=True)
            y_0 = parallel.decode(vae, z, gather=0)
            moments = parallel.encode(vae, x, gather="all")
        torch.save({"all": y_all, "to0": y_0, "enc": moments, "mode": report.mode, "rows": report.rows,
                    "sent": report.sent_bytes},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
