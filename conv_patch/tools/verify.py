"""Does conv-patch compute what PyTorch computes, on this model, here?

Two checks, both against references computed independently of the kernels:

* per layer: each patched convolution on seeded random activations, against a
  float64 convolution of the same (rounded) inputs; PyTorch's own result in the
  same dtype is measured the same way, for scale;
* end to end: the whole model patched and unpatched in the working dtype,
  each against the unpatched model in exact arithmetic (fp32 for a
  half-precision check, float64 for an fp32 one). The patched model passes
  when its error is at most 1.5x the unpatched model's (plus a floor for fp32,
  where both are near zero); on a GPU both are timed, interleaved.
"""

from __future__ import annotations

import re

import copy
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from conv_patch.api import patcher
from conv_patch.specs import HALF_DTYPES, Conv3dSpec, ConvSpec
from conv_patch.target import conv_tf32, conv_tf32_enabled
from conv_patch.runtime.state import state_of
from conv_patch.runtime.wrappers import PatchedConvMixin

# ||out - ref|| / ||ref|| a layer may reach against float64, whatever PyTorch
# itself reaches (twice PyTorch's own error always passes too).
LAYER_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
TF32_TOL = 5e-3
E2E_RATIO = 1.5
E2E_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
NAN_NOTE = "weights contain NaN/Inf: not compared"
# A 5-D weight's per-layer probe: a few frames, small in space. Its input
# and output are at most CONV3D_MAX_PROBE elements, and the work at most
# CONV3D_MAX_MACS multiply-adds (whole tiles under the interpreter: a few
# seconds there), whatever sizes the file's tensors claim.
CONV3D_FRAMES = 3
CONV3D_MAX_PROBE = 1 << 22
CONV3D_MAX_MACS = 1 << 33
# Under the interpreter one layer per distinct 3-D geometry is run, at most
# this many: a full Wan VAE has 61 Conv3d weights of 16 geometries.
CONV3D_MAX_INTERPRETED = 24


@dataclass
class LayerResult:
    name: str
    shape: str
    route: str
    rel_err: Optional[float]
    torch_rel_err: Optional[float]
    tolerance: float
    passed: bool
    note: str = ""


@dataclass
class EndToEnd:
    what: str
    input_shape: list
    rel_err_patched: float
    rel_err_unpatched: float
    max_abs_diff: float
    psnr_patched_vs_unpatched_db: float
    passed: bool
    # What rel_err_patched must not exceed: E2E_RATIO x the unpatched
    # error plus the dtype's floor (the floor decides where the unpatched
    # model is exact, as in fp32 on the CPU).
    bound: Optional[float] = None
    ms_unpatched: Optional[float] = None
    ms_patched: Optional[float] = None
    speedup: Optional[float] = None
    image_psnr_unpatched_db: Optional[float] = None
    image_psnr_patched_db: Optional[float] = None
    # Where the patched model raised instead of answering: what it raised
    # (the check fails; its errors are then inf).
    error: Optional[str] = None


@dataclass
class VerifyReport:
    model: str
    device: str
    dtype: str
    interpreter: bool
    layers: List[LayerResult] = field(default_factory=list)
    end_to_end: List[EndToEnd] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.layers) and all(e.passed for e in self.end_to_end)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float) -> float:
    mse = ((a.double() - b.double()) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(data_range ** 2 / mse)


def _layer_tolerance(dtype, device) -> float:
    if dtype == torch.float32 and device.type == "cuda" and conv_tf32_enabled():
        return TF32_TOL
    return LAYER_TOL[dtype]


def raised(e: BaseException) -> str:
    """A kernel's exception as one line of a report: a check that raises is
    a failed check, said so, not a traceback that ends the whole run."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"raised {type(e).__name__}" + (f": {first[:200]}" if first else "")


def check_layer(name: str, conv: nn.Module, size: int, seed: int) -> LayerResult:
    """One patched conv (already on its device and dtype) against float64."""
    spec = ConvSpec.from_module(conv)
    w = conv.weight
    device, dtype = w.device, w.dtype
    tol = _layer_tolerance(dtype, device)
    if not torch.isfinite(w).all() or (conv.bias is not None and not torch.isfinite(conv.bias).all()):
        return LayerResult(name, spec.describe(), "-", None, None, tol, True, NAN_NOTE)
    g = torch.Generator().manual_seed(seed)
    h = max(size // spec.stride[0] if spec.transposed else size, 1)
    # The probe is at least as large as the kernel's reach on each axis (a
    # 1x31 weight on an 8x8 probe would be a conv PyTorch rejects).
    hw = [h if spec.transposed else max(h, spec.dilation[i] * (spec.kernel[i] - 1) + 1) for i in range(2)]
    x = torch.randn(1, spec.in_channels, *hw, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            ours = conv(x)
        except Exception as e:  # noqa: BLE001 - reported as this layer's failure
            return LayerResult(name, spec.describe(), "-", None, None, tol, False, raised(e))
        route = state_of(conv).last.label() if isinstance(conv, PatchedConvMixin) else "not patched"
        theirs = conv.cp_fallback_forward(conv, x) if isinstance(conv, PatchedConvMixin) else ours
        b = None if conv.bias is None else conv.bias.double().cpu()
        args = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
        if spec.transposed:
            ref = F.conv_transpose2d(x.double().cpu(), w.double().cpu(), b, output_padding=conv.output_padding,
                                     **args)
        else:
            ref = F.conv2d(x.double().cpu(), w.double().cpu(), b, **args)
    err, terr = rel_err(ours, ref), rel_err(theirs, ref)
    passed = err <= max(tol, 2 * terr)
    return LayerResult(name, spec.describe(), route, err, terr, tol, passed)


def check_layers(model: nn.Module, size: int, progress: Optional[Callable] = None) -> List[LayerResult]:
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, PatchedConvMixin)]
    results = []
    for i, (name, m) in enumerate(convs):
        results.append(check_layer(name, m, size, seed=i))
        if progress:
            progress(i + 1, len(convs), name)
    return results


def _time_interleaved(fns, runs: int, warmup: int = 3) -> List[float]:
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[i].append(start.elapsed_time(end))
    return [statistics.median(s) for s in samples]


def _reference(model: nn.Module, run: Callable, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unpatched model's output in exact arithmetic: in float32 for a
    half-precision check; in float64 for a float32 one, where a float32
    reference would be the unpatched run itself (its error 0, so the patched
    run's own rounding, no larger, would be all the bound allows). A model
    that cannot run in float64 gives the float32 reference. ``model`` is
    left in float32."""
    with torch.no_grad(), conv_tf32(False):
        if dtype == torch.float32:
            try:
                return run(model.double(), x.double())
            except Exception:  # noqa: BLE001 - an op without float64: the float32 reference
                pass
            finally:
                model.float()
        return run(model, x.float())


def check_end_to_end(what: str, model: nn.Module, run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                     x: torch.Tensor, dtype: torch.dtype, timing_runs: int = 0,
                     image_range: Optional[tuple] = None, filter_fn=None) -> EndToEnd:
    """``model`` unpatched, on its device in fp32; ``run(model, x)`` gives the
    output. With ``image_range`` the run is a reconstruction of the image
    ``x``, and the PSNR of each output (clamped to the range) against it is
    reported too. The model is left patched (``filter_fn`` as for
    ``apply``), in ``dtype``."""
    ref = _reference(model, run, x, dtype)
    model.to(dtype)
    xd = x.to(dtype)
    timed = timing_runs and x.device.type == "cuda"
    # The unpatched twin is copied before patching: a patched model that ran
    # holds plans of no use to a copy.
    twin = copy.deepcopy(model) if timed else None
    with torch.no_grad():
        unpatched = run(model, xd)
        patcher.apply(model, filter_fn=filter_fn)
        try:
            patched = run(model, xd)
        except Exception as e:  # noqa: BLE001 - reported as this check's failure
            e_u = rel_err(unpatched, ref)
            return EndToEnd(what=what, input_shape=list(x.shape), rel_err_patched=math.inf, rel_err_unpatched=e_u,
                            max_abs_diff=math.inf, psnr_patched_vs_unpatched_db=-math.inf, passed=False,
                            bound=E2E_RATIO * e_u + E2E_FLOOR[dtype], error=raised(e))
    ms_u = ms_p = None
    if timed:
        with torch.no_grad():
            ms_u, ms_p = _time_interleaved([lambda: run(twin, xd), lambda: run(model, xd)], timing_runs)
        del twin
    e_p, e_u = rel_err(patched, ref), rel_err(unpatched, ref)
    rng = (ref.max() - ref.min()).item() or 1.0
    img_u = img_p = None
    if image_range is not None:
        lo, hi = image_range
        img_u, img_p = (psnr(y.float().clamp(lo, hi), x.float(), hi - lo) for y in (unpatched, patched))
    return EndToEnd(
        what=what, input_shape=list(x.shape), rel_err_patched=e_p, rel_err_unpatched=e_u,
        max_abs_diff=(patched.double() - unpatched.double()).abs().max().item(),
        psnr_patched_vs_unpatched_db=psnr(patched, unpatched, rng),
        passed=e_p <= E2E_RATIO * e_u + E2E_FLOOR[dtype], bound=E2E_RATIO * e_u + E2E_FLOOR[dtype],
        ms_unpatched=ms_u, ms_patched=ms_p, speedup=(ms_u / ms_p) if ms_u and ms_p else None,
        image_psnr_unpatched_db=img_u, image_psnr_patched_db=img_p,
    )


def _interpreted(device) -> bool:
    """Whether the kernels really run under the interpreter here (not merely
    TRITON_INTERPRET=1: without Triton nothing but PyTorch runs)."""
    from conv_patch.target import target_for
    t = target_for(device)
    return device.type == "cpu" and t.kernels and t.interpreter


def interpreter_note(size: str) -> str:
    """What a run on a CPU means: nothing is faster here; the kernels ran
    only to be checked."""
    return ("no usable GPU here: a patched model runs PyTorch's own code on this machine, no faster than "
            "unpatched. These checks ran the kernels themselves under the Triton interpreter on the CPU, "
            f"at a small size ({size}), to show they compute what PyTorch computes; nothing was timed")


def _no_kernels_note(device) -> Optional[str]:
    from conv_patch.target import target_for, what_runs
    if target_for(device).kernels:
        return None
    return f"no kernel ran: {what_runs(device)}; every check compared PyTorch with itself"


def embedded_default(device: torch.device, dtype: torch.dtype, size: Optional[int],
                     progress: Optional[Callable] = None) -> VerifyReport:
    """The main job: the package's own TAEF2-architecture decoder (seeded
    weights, nothing downloaded), per layer and end to end."""
    from conv_patch.tools import taesd

    image = size or (512 if device.type == "cuda" else 32)
    if image % 8:
        raise ValueError(f"--size {image}: must be a multiple of 8 (the decoder upsamples 8x)")
    model = taesd.seeded_(taesd.decoder()).to(device).eval()
    report = VerifyReport(model="embedded default: TAEF2-architecture decoder, seeded weights",
                          device=str(device), dtype=str(dtype).replace("torch.", ""),
                          interpreter=_interpreted(device))
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 32, image // 8, image // 8, generator=g).to(device)
    report.end_to_end.append(check_end_to_end(f"decode {image}x{image}", model, lambda m, t: m(t), z, dtype,
                                              timing_runs=20))
    report.layers = check_layers(model, size=64 if device.type == "cuda" else 12, progress=progress)
    if report.interpreter:
        report.notes.append(interpreter_note(f"{image}x{image}"))
    elif _no_kernels_note(device):
        report.notes.append(_no_kernels_note(device))
    return report


# -- checkpoint files -------------------------------------------------------------

def _natural(name: str) -> list:
    """Sort key that orders ``2.conv`` before ``10.conv``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


def conv_weight_names(state: dict) -> List[str]:
    """Every 4-D (Conv2d) and 5-D (Conv3d) floating-point ``*weight``
    tensor: the file's convolutions, in natural order (layer 2 before 10)."""
    return sorted((k for k, v in state.items()
                   if k.endswith("weight") and v.dim() in (4, 5) and v.is_floating_point() and min(v.shape) > 0),
                  key=_natural)


def _conv3d_macs(shape, out_voxels, interpreted) -> int:
    """The multiply-adds of a 5-D conv; under the interpreter, of the whole
    tiles it computes (a 1-output-channel conv still runs a full tile)."""
    from conv_patch.ops.conv3d import CONV3D_TILES
    m, n, k = out_voxels, shape[0], math.prod(shape[1:5])
    if interpreted:
        t = CONV3D_TILES["interpreter"]
        m, n, k = (-(-a // t[b]) * t[b] for a, b in ((m, "BLOCK_M"), (n, "BLOCK_N"), (k, "BLOCK_K")))
    return m * n * k


def check_layer3d(name: str, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: tuple, pads: tuple,
                  frames: int, size: int, seed: int) -> LayerResult:
    """One 5-D weight (already on its device and dtype): ``functional.conv3d``
    with the kernel route against float64 ``F.conv3d`` on seeded random
    frames, PyTorch's own conv3d in the same dtype measured the same way.
    Geometry: per-axis stride and (front, back) padding, as a causal conv
    has (2p frames in front, none behind)."""
    from conv_patch.ops import conv3d as conv3d_op
    from conv_patch import functional
    device, dtype = weight.device, weight.dtype
    tol = _layer_tolerance(dtype, device)
    desc = Conv3dSpec(weight.shape[1], weight.shape[0], tuple(weight.shape[2:5]), tuple(stride),
                                (1, 1, 1), tuple(pads), 1, "zeros", bias is not None).describe()
    if not torch.isfinite(weight).all() or (bias is not None and not torch.isfinite(bias).all()):
        return LayerResult(name, desc, "-", None, None, tol, True, NAN_NOTE)
    interpreted = _interpreted(device)

    def probe(side):
        # At least as long as the kernel's reach on each axis.
        ext = [max(e, k - f - b, 1) for e, k, (f, b) in zip((frames, side, side), weight.shape[2:5], pads)]
        out = [(e + f + b - k) // s + 1 for e, k, (f, b), s in zip(ext, weight.shape[2:5], pads, stride)]
        fits = (weight.shape[1] * math.prod(ext) <= CONV3D_MAX_PROBE
                and weight.shape[0] * math.prod(out) <= CONV3D_MAX_PROBE
                and _conv3d_macs(tuple(weight.shape), math.prod(out), interpreted) <= CONV3D_MAX_MACS)
        return ext, fits

    # A wide layer is probed smaller in space (its float64 reference runs on
    # the CPU) rather than not at all.
    side = size
    ext, fits = probe(side)
    while not fits and side > 1:
        side //= 2
        ext, fits = probe(side)
    if not fits:
        return LayerResult(name, desc, "-", None, None, tol, True,
                           "too large for a per-layer check here: not compared")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, weight.shape[1], *ext, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            ours = functional.conv3d(x, weight, bias, stride, padding=pads, route="kernel")
        except Exception as e:  # noqa: BLE001 - reported as this layer's failure
            return LayerResult(name, desc, "-", None, None, tol, False, raised(e))
        theirs = conv3d_op.torch_conv3d(x, weight, bias, None, pads, stride, (1, 1, 1))
        ref = conv3d_op.torch_conv3d(x.double().cpu(), weight.double().cpu(),
                                     None if bias is None else bias.double().cpu(), None, pads, stride, (1, 1, 1))
    ran = functional.conv3d_decision(x, weight, bias, stride, pads, (1, 1, 1))
    err, terr = rel_err(ours, ref), rel_err(theirs, ref)
    return LayerResult(name, desc, ran.route.value if ran.is_kernel else "pytorch (no kernel here)", err, terr, tol,
                       err <= max(tol, 2 * terr))


def _file_dtype(state: dict, names: List[str]) -> torch.dtype:
    dtypes = [state[n].dtype for n in names]
    common = max(set(dtypes), key=dtypes.count)
    return common if common in HALF_DTYPES else torch.bfloat16


def check_file_layers(state: dict, fmt, device, dtype, size: int,
                      progress: Optional[Callable] = None, notes: Optional[list] = None) -> List[LayerResult]:
    """Each conv weight of the file, as a conv of the geometry its format
    gives it (stride 1, 'same' padding when the format is unknown). 5-D
    weights run through ``functional.conv3d`` on a few frames; under the
    interpreter one per distinct geometry (``notes`` gets a line on the
    rest)."""
    from conv_patch.runtime.wrappers import PatchedConv2d
    names = conv_weight_names(state)
    interpreted = _interpreted(device)
    results, seen, repeats, over = [], {}, 0, 0
    for i, name in enumerate(names):
        w = state[name]
        bias = state.get(name[: -len("weight")] + "bias")
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            bias = None
        if w.dim() == 5:
            stride, pads = fmt.geometry3d(name, tuple(w.shape))
            key = (tuple(w.shape), stride, pads, bias is not None)
            finite = bool(torch.isfinite(w).all()) and (bias is None or bool(torch.isfinite(bias).all()))
            if interpreted and finite and key in seen:
                repeats += 1
            elif interpreted and finite and len(seen) >= CONV3D_MAX_INTERPRETED:
                over += 1
            else:
                if finite:  # a NaN weight is a finding, not its geometry's check
                    seen.setdefault(key, name)
                results.append(check_layer3d(name[: -len(".weight")] or name, w.to(device=device, dtype=dtype),
                                             None if bias is None else bias.to(device=device, dtype=dtype),
                                             stride, pads, CONV3D_FRAMES, min(size, 8 if interpreted else 32),
                                             seed=i))
            if progress:
                progress(i + 1, len(names), name)
            continue
        stride, pad = fmt.geometry(name, tuple(w.shape))
        conv = nn.Conv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]), stride=stride, padding=pad,
                         bias=bias is not None)
        with torch.no_grad():
            conv.weight.copy_(w.float())
            if bias is not None:
                conv.bias.copy_(bias.float())
        conv = PatchedConv2d.wrap(conv.to(device=device, dtype=dtype).requires_grad_(False))
        results.append(check_layer(name[: -len(".weight")] or name, conv, size, seed=i))
        if progress:
            progress(i + 1, len(names), name)
    if notes is not None and (repeats or over):
        notes.append(f"Conv3d weights: {len(seen)} checked, one per distinct shape and geometry (under the "
                     "interpreter, to stay fast on a CPU)" + (f"; {repeats} more of those geometries not re-run"
                                                              if repeats else "")
                     + (f"; {over} of further geometries past the first {CONV3D_MAX_INTERPRETED} not run"
                        if over else "") + " (all checked for NaN/Inf)")
    return results


def read_image(path: str):
    """The image at ``path`` as RGB (PIL), or a one-line ValueError naming
    the file; ``convpatch verify`` calls it before any layer is checked."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("--image needs Pillow (pip install pillow)") from None
    try:
        return Image.open(path).convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such image file") from None
    except Exception as e:
        raise ValueError(f"{path}: cannot read as an image ({type(e).__name__})") from None


def load_image(path: str, size: int, value_range: tuple) -> torch.Tensor:
    """[1, 3, size, size] in ``value_range``: centre square, resized."""
    from PIL import Image
    img = read_image(path)
    side = min(img.size)
    left, top = (img.size[0] - side) // 2, (img.size[1] - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.LANCZOS)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
    x = x.permute(2, 0, 1)[None].float() / 255
    lo, hi = value_range
    return x * (hi - lo) + lo


class _Pair(nn.Module):
    """A separate encoder and decoder file, run as encode then decode."""

    def __init__(self, enc, dec):
        super().__init__()
        self.enc, self.dec = enc, dec


def _default_size(fmt, device, image: bool) -> int:
    if fmt.latent_frames:
        # A video model runs several frames: 2 latent pixels on the CPU,
        # a modest size on a GPU.
        return max(fmt.factor * 2, 64 if image else 16) if device.type != "cuda" else 256
    if device.type == "cuda":
        return 512
    # Interpreter: small, but a real image needs a few latent pixels.
    return 64 if (image or fmt.kind.startswith(("taesd", "diffusers-autoencodertiny"))) else 32


def verify_files(paths, device, dtype=None, size=None, image=None, allow_pickle=False,
                 progress: Optional[Callable] = None) -> List[VerifyReport]:
    """One report per checkpoint: per-layer checks, then end-to-end checks
    when its architecture is recognised. A TAESD-style encoder and decoder
    given together with ``image`` are also checked as one reconstruction.
    Raises checkpoint.CheckpointError / ValueError for bad input."""
    from conv_patch.tools import checkpoint, formats

    timing = 20 if device.type == "cuda" else 0
    loaded = []
    for path in paths:
        state = checkpoint.load(path, allow_pickle=allow_pickle)
        names = conv_weight_names(state)
        if not names:
            raise checkpoint.CheckpointError(f"{path}: holds no convolution weights (no 4-D or 5-D "
                                             "floating-point tensor named *weight)")
        fmt = formats.recognise({k: tuple(v.shape) for k, v in state.items()})
        if fmt.problem:
            raise checkpoint.CheckpointError(f"{path}: {fmt.problem}")
        loaded.append((path, state, fmt))

    reports, runnable = [], []
    for path, state, fmt in loaded:
        names = conv_weight_names(state)
        dt = dtype or (_file_dtype(state, names) if device.type == "cuda" else torch.float32)
        s = size or _default_size(fmt, device, image is not None)
        if s % max(fmt.factor, 1):
            raise ValueError(f"--size {s}: must be a multiple of {fmt.factor} for {path}")
        rep = VerifyReport(model=f"{path}: {fmt.description}", device=str(device),
                           dtype=str(dt).replace("torch.", ""),
                           interpreter=_interpreted(device))
        rep.layers = check_file_layers(state, fmt, device, dt, 64 if device.type == "cuda" else 12,
                                       progress, rep.notes)
        bad = [r.name for r in rep.layers if r.note == NAN_NOTE]
        if bad:
            rep.notes.append(f"finding: {len(bad)} conv weight(s) contain NaN/Inf ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}); end-to-end checks skipped")
        if not fmt.recognised:
            rep.notes.append(f"{fmt.description}: per-layer checks only")
        elif not bad:
            try:
                _file_end_to_end(rep, fmt, state, device, dt, s, image, timing)
                runnable.append((len(reports), fmt, state, dt, s))
            except ImportError as e:
                rep.notes.append(f"end-to-end checks need {e.name or 'diffusers'} (pip install "
                                 f"'conv-patch[diffusers]'): per-layer checks only")
            except (KeyError, RuntimeError, ValueError) as e:
                # Looked like a known format but its weights do not fit the model.
                rep.end_to_end.clear()
                rep.notes.append(f"looks like {fmt.kind} but the model could not be built from it "
                                 f"({type(e).__name__}: {str(e).strip().splitlines()[0][:120]}): "
                                 "per-layer checks only")
        if fmt.latent_frames and rep.end_to_end and device.type != "cuda":
            rep.notes.append("end to end: conv-patch runs this video VAE's Conv2d layers (resample, attention); "
                             "its Conv3d layers run PyTorch's conv3d, patched and unpatched alike (the per-layer "
                             "checks cover the Conv3d kernel)")
        if rep.interpreter:
            frames = f", {fmt.video_frames} frames" if fmt.latent_frames else ""
            rep.notes.append(interpreter_note(f"{s}x{s}{frames}"))
        elif _no_kernels_note(device):
            rep.notes.append(_no_kernels_note(device))
        reports.append(rep)

    # Separate encoder and decoder files pair up for images only.
    encs = [(i, r) for i, r in enumerate(runnable) if r[1].encode and not r[1].decode and not r[1].latent_frames]
    decs = [(i, r) for i, r in enumerate(runnable) if r[1].decode and not r[1].encode and not r[1].latent_frames]
    if image is not None and encs and decs:
        (_, (_, efmt, estate, dt, s)), (di, (_, dfmt, dstate, _, _)) = encs[0], decs[0]
        if efmt.latent_channels == dfmt.latent_channels:
            pair = _Pair(efmt.build(estate), dfmt.build(dstate)).to(device).eval()
            x = load_image(image, s, efmt.image_range).to(device)
            reports[runnable[di][0]].end_to_end.append(check_end_to_end(
                f"encode->decode {image} at {s}x{s} (encoder and decoder files)", pair,
                lambda m, t: dfmt.decode(m.dec, efmt.encode(m.enc, t)), x, dt, timing, efmt.image_range))
    if image is not None and not any(e.image_psnr_patched_db is not None for r in reports for e in r.end_to_end):
        reports[-1].notes.append("--image needs an encoder and a decoder: a file holding both, or the "
                                 "matching encoder and decoder files together")
    return reports


def _file_end_to_end(rep, fmt, state, device, dtype, size, image, timing):
    if fmt.latent_frames:
        return _video_end_to_end(rep, fmt, state, device, dtype, size, image, timing)
    g = torch.Generator().manual_seed(0)
    lo, hi = fmt.image_range
    if fmt.decode:
        z = torch.randn(1, fmt.latent_channels, size // fmt.factor, size // fmt.factor, generator=g)
        rep.end_to_end.append(check_end_to_end(f"decode {size}x{size}", fmt.build(state).to(device).eval(),
                                               fmt.decode, z.to(device), dtype, timing))
    if fmt.encode:
        x = torch.rand(1, 3, size, size, generator=g) * (hi - lo) + lo
        rep.end_to_end.append(check_end_to_end(f"encode {size}x{size}", fmt.build(state).to(device).eval(),
                                               fmt.encode, x.to(device), dtype, timing))
    if image is not None and fmt.decode and fmt.encode:
        x = load_image(image, size, fmt.image_range).to(device)
        rep.end_to_end.append(check_end_to_end(
            f"encode->decode {image} at {size}x{size}", fmt.build(state).to(device).eval(),
            lambda m, t: fmt.decode(m, fmt.encode(m, t)), x, dtype, timing, fmt.image_range))


def _video_end_to_end(rep, fmt, state, device, dtype, size, image, timing):
    """A video VAE: seeded latent frames decoded, seeded frames encoded, and
    ``image`` as a one-frame video through both (its reconstruction PSNR)."""
    g = torch.Generator().manual_seed(0)
    lo, hi = fmt.image_range
    lat = size // fmt.factor
    # The Conv3d layers are checked per layer. End to end on a GPU they are
    # patched like the rest (the dispatch core's routes: the kernel where the
    # table measured it faster, else the cuDNN route); under the interpreter
    # they run PyTorch's conv3d (the kernel over every frame chunk of a
    # decode takes minutes there).
    no_conv3d = None if device.type == "cuda" else (lambda m, fqn: not isinstance(m, nn.Conv3d))
    if fmt.decode:
        z = torch.randn(1, fmt.latent_channels, fmt.latent_frames, lat, lat, generator=g)
        rep.end_to_end.append(check_end_to_end(f"decode {fmt.latent_frames} latent frames to {size}x{size}",
                                               fmt.build(state).to(device).eval(), fmt.decode, z.to(device),
                                               dtype, timing, filter_fn=no_conv3d))
    if fmt.encode:
        x = torch.rand(1, 3, fmt.video_frames, size, size, generator=g) * (hi - lo) + lo
        rep.end_to_end.append(check_end_to_end(f"encode {fmt.video_frames} frames of {size}x{size}",
                                               fmt.build(state).to(device).eval(), fmt.encode, x.to(device),
                                               dtype, timing, filter_fn=no_conv3d))
    if image is not None and fmt.decode and fmt.encode:
        x = load_image(image, size, fmt.image_range)[:, :, None].to(device)
        rep.end_to_end.append(check_end_to_end(
            f"encode->decode {image} as one frame at {size}x{size}", fmt.build(state).to(device).eval(),
            lambda m, t: fmt.decode(m, fmt.encode(m, t)), x, dtype, timing, fmt.image_range, filter_fn=no_conv3d))
