"""Convolution shapes of the diffusion VAEs the benchmarks run, derived from
the architecture rather than copied from a trace."""

from collections import Counter


def autoencoder_kl_decoder_convs(resolution, block_out=(128, 256, 512, 512), layers=2, latent=16):
    """Counter of (C_in, C_out, k, H) over the diffusers AutoencoderKL decoder
    (FLUX.1 / SD3 config by default: 16 latent channels, no post-quant conv).
    H is the input's height = width."""
    convs = Counter()
    h = resolution // 2 ** (len(block_out) - 1)
    ch = block_out[-1]
    convs[(latent, ch, 3, h)] += 1                     # conv_in
    convs[(ch, ch, 3, h)] += 4                         # mid block: two resnets
    for i, out in enumerate(reversed(block_out)):
        for j in range(layers + 1):
            c_in = ch if j == 0 else out
            convs[(c_in, out, 3, h)] += 1              # resnet conv1
            convs[(out, out, 3, h)] += 1               # resnet conv2
            if c_in != out:
                convs[(c_in, out, 1, h)] += 1          # conv_shortcut
        ch = out
        if i < len(block_out) - 1:
            h *= 2
            convs[(ch, ch, 3, h)] += 1                 # upsampler conv after nearest x2
    convs[(ch, 3, 3, h)] += 1                          # conv_out
    return convs
