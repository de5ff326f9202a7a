"""conv_patch.warmup: the first calls of a signature made ahead (plans built,
kernels compiled), so that the user's next call at that signature builds
nothing; another signature is built on its own call."""

import pytest
import torch
from torch import nn

import conv_patch
from conv_patch.runtime.plans import BuildCount
from _util import rel_err


def _net(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.SiLU(), nn.Conv2d(6, 5, 3, stride=2, padding=1),
                         nn.ConvTranspose2d(5, 4, 4, 2, 1)).to(device).eval()


def test_warmup_builds_ahead_and_later_calls_build_nothing(device, exact_fp32):
    net = _net(device)
    x = torch.randn(2, 3, 9, 7, device=device)
    with torch.no_grad():
        ref = net(x)
    conv_patch.apply(net)
    report = conv_patch.warmup(net, x)
    assert len(report.seconds) == 3 and all(s > 0 for s in report.seconds)
    assert report.plans_built[0] >= 3 and report.plans_built[1:] == [0, 0], report.plans_built
    assert "3 calls" in str(report)
    before = BuildCount.total
    with torch.no_grad():  # the user's call, in another mode: served by what warmup built
        y = net(x)
    assert BuildCount.total == before and rel_err(y, ref) <= 1e-5
    # Another signature (size) is another build.
    with torch.no_grad():
        net(torch.randn(1, 3, 5, 6, device=device))
    assert BuildCount.total > before


def test_warmup_takes_any_callable_and_keyword_arguments(device, exact_fp32):
    net = _net(device)
    conv_patch.apply(net)
    seen = []

    def decode(z, *, scale):
        seen.append(scale)
        return net(z * scale)
    report = conv_patch.warmup(decode, torch.randn(1, 3, 6, 6, device=device), scale=0.5, calls=2)
    assert seen == [0.5, 0.5] and len(report.plans_built) == 2 and report.plans_built[0] > 0
    with pytest.raises(ValueError, match="at least one call"):
        conv_patch.warmup(net, torch.randn(1, 3, 6, 6, device=device), calls=0)
