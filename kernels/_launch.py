"""Host-side helpers shared by the launchers (no Triton code here).

Plain integer arithmetic on purpose: ``triton.cdiv`` and
``triton.next_power_of_2`` are constexpr functions in Triton 3.x and cost
microseconds per host-side call, which adds up on every launch.
"""

INT32_LIMIT = 2**31 - 1

# tl.dot needs every block dimension >= 16.
MIN_DOT_BLOCK = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def span(t):
    """Elements between the first and one past the last addressed element."""
    if t is None or t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))


def needs_int64(*tensors):
    for t in tensors:
        # The storage bounds every offset from the data pointer; the exact
        # span is only worked out when that bound is too loose to decide.
        if t is not None and t.untyped_storage().nbytes() // t.element_size() > INT32_LIMIT \
                and span(t) > INT32_LIMIT:
            return True
    return False


def block_sizes(config, c_in, c_out):
    """The table's tile, narrowed to the channel counts: a 3-channel output
    would otherwise spend 125 of 128 columns on masked work."""
    bm = int(config["BLOCK_M"])
    bn = min(int(config["BLOCK_N"]), max(MIN_DOT_BLOCK, next_pow2(c_out)))
    bk = min(int(config["BLOCK_K"]), max(MIN_DOT_BLOCK, next_pow2(c_in)))
    return bm, bn, bk


def run_conv_kernel(kernel, grid_fn, x, w, bias, out, residual, *, stride, padding,
                    dilation, beta, activation, out_scale, config, precision, upcast,
                    force_int64=False):
    """Launch one of the implicit-GEMM kernels, which share one signature.

    ``w`` is viewed as [C_out, C_in, KH, KW] whatever its storage; ``out`` is
    preallocated; ``padding`` is (top, left). ``grid_fn(bm, bn)`` sizes the grid.
    """
    N, C_in, H, W = x.shape
    C_out, _, KH, KW = w.shape
    bm, bn, bk = block_sizes(config, C_in, C_out)
    res = residual if residual is not None else out
    kernel[grid_fn(bm, bn)](
        x, w, bias if bias is not None else out, res, out,
        N, C_in, H, W, C_out, out.shape[2], out.shape[3],
        *x.stride(), *w.stride(), *res.stride(), *out.stride(),
        KH, KW, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
        float(beta), float(out_scale),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=int(activation),
        IDX64=bool(force_int64 or needs_int64(x, w, out, residual)),
        UPCAST=bool(upcast), PRECISION=precision,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=int(config.get("GROUP_M", 8)),
        num_warps=int(config.get("num_warps", 4)),
        num_stages=int(config.get("num_stages", 2)),
    )
    return out
