"""Where the bands live and how they reach each other.

A ``Banded`` activation is one tensor of a VAE held as row bands: ``parts[i]``
is band ``i`` (None where another process holds it) and, where all its rows
are on this process's device, ``whole`` (then every part is a view of it and a
band plus its halo is a view too: nothing is copied to read it).

A ``Comm`` moves what a layer needs: the halo rows a band's conv reads from
its neighbours, the per-band GroupNorm moments, the whole tensor for an
attention that sees every token, the output. ``LocalComm`` holds every band
in one process (the sequential mode: all bands on the device, or staged to
host memory band by band); ``DistComm`` holds one band per rank of a
``torch.distributed`` group and exchanges halo rows by point-to-point
send/recv, moments and whole tensors by all-gather.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from conv_patch.parallel.geometry import Level, Window, halo_of


class Banded:
    """An activation as bands of ``level``: ``parts`` per band (this
    process's, on the device or staged on the host), ``whole`` where all
    rows are here on the device."""

    def __init__(self, level: Level, parts: List[Optional[torch.Tensor]], whole: Optional[torch.Tensor] = None):
        self.level, self.parts, self.whole = level, parts, whole
        # Halo rows received from other ranks for the next layer: band -> (above, below).
        self.halo = {}
        # GroupNorm moments of each band, computed as the band was made
        # (groups -> [3, N, G] per band, None for bands not held): a staged
        # band's statistics without reading it back from the host.
        self.moments = {}

    @classmethod
    def of_whole(cls, level: Level, x: torch.Tensor) -> "Banded":
        return cls(level, [x[:, :, a:b] for a, b in zip(level.edges[:-1], level.edges[1:])], x)

    def like(self) -> torch.Tensor:
        """A tensor of this activation (for its dtype, layout, batch, width)."""
        return self.whole if self.whole is not None else next(p for p in self.parts if p is not None)


def memory_format(x: torch.Tensor) -> torch.memory_format:
    return (torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            else torch.contiguous_format)


class Comm:
    """The bands of this process (``held``) and the moves between bands."""

    nbands: int
    held: List[int]
    device: torch.device
    staged = False

    def window(self, act: Banded, i: int, win: Window) -> torch.Tensor:
        """Rows ``win.lo:win.hi`` of ``act`` on the device, for band ``i``:
        a view of ``act.whole`` where there is one, else the band and its
        halo rows written into one buffer (a band-sized copy, never the
        whole image's)."""
        if act.whole is not None:
            return act.whole[:, :, win.lo:win.hi]
        own = act.level.rows(i)
        up, down = halo_of(win, own)
        pieces = []
        if up:
            pieces.append(self._above(act, i, up))
        pieces.append(act.parts[i][:, :, win.lo + up - own[0]:win.hi - down - own[0]])
        if down:
            pieces.append(self._below(act, i, down))
        ref = act.parts[i]
        if len(pieces) == 1 and ref.device == self.device:
            return pieces[0]
        n, c, _, w = ref.shape
        buf = torch.empty((n, c, win.hi - win.lo, w), dtype=ref.dtype, device=self.device,
                          memory_format=memory_format(ref))
        r = 0
        for p in pieces:
            buf[:, :, r:r + p.shape[2]].copy_(p, non_blocking=True)
            r += p.shape[2]
        return buf

    def prepare(self, act: Banded, wins: Sequence[Window]) -> None:
        """Make the halo rows of ``wins`` available to ``window`` (a
        distributed exchange; nothing to do in one process)."""

    def begin(self, level: Level, stats=None) -> "Output":
        """A layer's output, band by band. ``stats``: (groups, fn) where the
        next layer normalises it: ``fn(band)`` is taken of every band not
        written into a whole tensor, before it is kept."""
        return Output(self, level, stats)

    def keep(self, y: torch.Tensor, height: int) -> torch.Tensor:
        """How a finished band of a layer of ``height`` rows is kept: on
        the device, or staged to host."""
        return y

    def finished(self, out: "Output") -> None:
        """A layer's output is complete (``LocalComm`` counts where they went)."""

    def all_moments(self, local: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Every band's moments in band order, from this process's bands'."""
        raise NotImplementedError

    def whole(self, act: Banded) -> torch.Tensor:
        """All rows of ``act`` on the device of every process."""
        raise NotImplementedError

    def output(self, act: Banded, gather: Union[str, int]) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def _above(self, act, i, rows):
        raise NotImplementedError

    def _below(self, act, i, rows):
        raise NotImplementedError


class Output:
    """A layer's output being written band by band: where every band stays
    on the device (``LocalComm`` unstaged) into one whole tensor, allocated
    at the first band, each band's result written straight into its rows
    (``target`` is the view to pass as the step's ``out``)."""

    def __init__(self, comm: Comm, level: Level, stats=None):
        self.comm, self.level, self.stats = comm, level, stats
        self.parts: List[Optional[torch.Tensor]] = [None] * level.bands
        self.moments: List[Optional[torch.Tensor]] = [None] * level.bands
        self.whole: Optional[torch.Tensor] = None

    def target(self, i: int, like: torch.Tensor, channels: int, width: int) -> Optional[torch.Tensor]:
        if not isinstance(self.comm, LocalComm) or self.comm.staged:
            return None
        if self.whole is None:
            n = like.shape[0]
            self.whole = torch.empty((n, channels, self.level.height, width), dtype=like.dtype, device=like.device,
                                     memory_format=memory_format(like))
        a, b = self.level.rows(i)
        return self.whole[:, :, a:b]

    def put(self, i: int, y: torch.Tensor) -> None:
        a, b = self.level.rows(i)
        if y.shape[2] != b - a:
            raise RuntimeError(f"band {i}: {y.shape[2]} rows computed for {b - a}")  # a geometry bug, never silent
        if self.whole is not None:
            dst = self.whole[:, :, a:b]
            if y.data_ptr() != dst.data_ptr() or y.stride() != dst.stride():
                dst.copy_(y)
            self.parts[i] = dst
        else:
            if self.stats is not None:
                self.moments[i] = self.stats[1](y)
            self.parts[i] = self.comm.keep(y, self.level.height)

    def done(self) -> Banded:
        self.comm.finished(self)
        out = Banded(self.level, self.parts, self.whole)
        if self.stats is not None and any(m is not None for m in self.moments):
            out.moments[self.stats[0]] = self.moments
        return out


class LocalComm(Comm):
    """Every band in this process, run one after the other. ``staged``:
    the finished bands of a layer whose whole output exceeds ``keep_bytes``
    are copied to host memory (``staging.HostStaging``: pinned on CUDA,
    exact-size buffers reused band to band and kept for the next call) and
    brought back for the layers that read them, so the device holds a few
    bands of such layers at a time; smaller layers (the low resolutions)
    stay on the device. On CUDA the copies to the host run on a side stream,
    behind the next band's compute, and a staged band's window for the next
    band is brought back on another while the current one computes; a layer
    is complete when its copies are. ``device_layers`` / ``staged_layers``
    count which happened, ``staged_bytes`` what went to the host."""

    def __init__(self, nbands: int, device: torch.device, staged: bool = False, keep_bytes: float = 0):
        self.nbands, self.device, self.staged, self.keep_bytes = nbands, torch.device(device), staged, keep_bytes
        self.held = list(range(nbands))
        self.cuda = self.device.type == "cuda"
        self.device_layers = self.staged_layers = 0
        self.staged_bytes = 0
        self._staging = False  # a band of the layer being written went to host
        self._pool = None
        self._to_host = self._to_device = None  # the copy streams (CUDA, staged)
        self._wins = {}  # id(act) -> the windows of the layer reading it
        self._ahead = None  # (id(act), band, window tensor, event): the next band's window, on its way

    @property
    def pool(self):
        if self._pool is None:
            from conv_patch.parallel.staging import pool_for
            self._pool = pool_for(self.device)
            self._pool.peak_bytes = self._pool.in_use
            self._pin0 = self._pool.pin_seconds
        return self._pool

    @property
    def pin_seconds(self) -> float:
        """Seconds this run spent pinning new host buffers."""
        return 0.0 if self._pool is None else self._pool.pin_seconds - self._pin0

    def _streams(self):
        if self._to_host is None:
            self._to_host = torch.cuda.Stream(self.device)
            self._to_device = torch.cuda.Stream(self.device)
        return self._to_host, self._to_device

    def keep(self, y, height):
        if not self.staged or y.numel() * y.element_size() * height <= self.keep_bytes * max(1, y.shape[2]):
            return y
        self._staging = True
        nhwc = memory_format(y) == torch.channels_last
        host = self.pool.take(tuple(y.shape), y.dtype, nhwc)
        self.staged_bytes += y.numel() * y.element_size()
        if not self.cuda:
            return host.copy_(y)
        to_host, _ = self._streams()
        to_host.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(to_host):
            host.copy_(y, non_blocking=True)
        y.record_stream(to_host)  # its memory is not reused before the copy is done
        return host

    def finished(self, out):
        if self._staging:
            self.staged_layers += 1
            if self.cuda:
                # The layer's bands are on the host before any layer reads them.
                torch.cuda.current_stream(self.device).wait_stream(self._streams()[0])
        else:
            self.device_layers += 1
        self._staging = False

    def prepare(self, act, wins):
        if self.staged and self.cuda and act.whole is None:
            self._wins = {id(act): list(wins)}

    def window(self, act, i, win):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == id(act) and ahead[1] == i:
            buf, ready = ahead[2], ahead[3]
            torch.cuda.current_stream(self.device).wait_event(ready)
        else:
            buf = super().window(act, i, win)
        wins = self._wins.get(id(act))
        if wins is not None and i + 1 < len(wins) and act.parts[i + 1] is not None \
                and act.parts[i + 1].device.type == "cpu":
            # The next band's rows, brought back while this band computes.
            _, to_device = self._streams()
            to_device.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(to_device):
                nxt = super().window(act, i + 1, wins[i + 1])
                ready = torch.cuda.Event()
                ready.record(to_device)
            nxt.record_stream(torch.cuda.current_stream(self.device))
            self._ahead = (id(act), i + 1, nxt, ready)
        return buf

    def _above(self, act, i, rows):
        return act.parts[i - 1][:, :, -rows:]

    def _below(self, act, i, rows):
        return act.parts[i + 1][:, :, :rows]

    def all_moments(self, local):
        return list(local)

    def whole(self, act):
        if act.whole is not None:
            return act.whole
        # Written band by band into one tensor: never the bands twice on the device.
        ref = act.parts[0]
        out = torch.empty((ref.shape[0], ref.shape[1], act.level.height, ref.shape[3]), dtype=ref.dtype,
                          device=self.device, memory_format=memory_format(ref))
        for i, p in enumerate(act.parts):
            a, b = act.level.rows(i)
            out[:, :, a:b].copy_(p, non_blocking=True)
        return out

    def output(self, act, gather):
        return self.whole(act)


class DistComm(Comm):
    """One band per rank of ``group`` (band ``i`` on the group's rank ``i``):
    halo rows by send/recv between neighbours, moments and whole tensors by
    all-gather (NCCL on GPUs, gloo on the CPU). ``sent_bytes`` counts what
    this rank hands to the others (a tensor all-gathered counts once per
    peer that receives it)."""

    def __init__(self, group, device: torch.device):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.nbands = dist.get_rank(group), dist.get_world_size(group)
        self.held = [self.rank]
        self.device = torch.device(device)
        self.sent_bytes = 0

    def _sent(self, t: torch.Tensor, peers: int = 1) -> None:
        self.sent_bytes += t.numel() * t.element_size() * peers

    def _peer(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)

    def prepare(self, act, wins):
        if act.whole is not None:
            return  # every rank has every row (the input, or after an attention)
        r, lv, dist = self.rank, act.level, self.dist
        a, b = lv.rows(r)
        part = act.parts[r]
        ops, recv = [], {}
        up, down = halo_of(wins[r], (a, b))
        n, c, _, w = part.shape

        def buf(rows):
            return torch.empty((n, c, rows, w), dtype=part.dtype, device=part.device)

        if up:
            recv["up"] = buf(up)
            ops.append(dist.P2POp(dist.irecv, recv["up"], self._peer(r - 1), self.group))
        if down:
            recv["down"] = buf(down)
            ops.append(dist.P2POp(dist.irecv, recv["down"], self._peer(r + 1), self.group))
        sends = []
        if r > 0:  # the rows above-neighbour's window reads from this band
            need = halo_of(wins[r - 1], lv.rows(r - 1))[1]
            if need:
                sends.append((part[:, :, :need].contiguous(), r - 1))
        if r + 1 < self.nbands:
            need = halo_of(wins[r + 1], lv.rows(r + 1))[0]
            if need:
                sends.append((part[:, :, part.shape[2] - need:].contiguous(), r + 1))
        ops += [dist.P2POp(dist.isend, t, self._peer(p), self.group) for t, p in sends]
        for t, _ in sends:
            self._sent(t)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        act.halo[r] = (recv.get("up"), recv.get("down"))

    def _above(self, act, i, rows):
        return act.halo[i][0]

    def _below(self, act, i, rows):
        return act.halo[i][1]

    def all_moments(self, local):
        (mine,) = local
        out = [torch.empty_like(mine) for _ in range(self.nbands)]
        self.dist.all_gather(out, mine.contiguous(), group=self.group)
        self._sent(mine, self.nbands - 1)
        return out

    def _padded(self, act):
        """This rank's band padded to the tallest band (all_gather needs
        equal shapes), dense NCHW."""
        lv = act.level
        tallest = max(b - a for a, b in zip(lv.edges[:-1], lv.edges[1:]))
        part = act.parts[self.rank]
        n, c, h, w = part.shape
        buf = torch.zeros((n, c, tallest, w), dtype=part.dtype, device=part.device)
        buf[:, :, :h].copy_(part)
        return buf

    def whole(self, act):
        if act.whole is not None:
            return act.whole
        mine = self._padded(act)
        got = [torch.empty_like(mine) for _ in range(self.nbands)]
        self.dist.all_gather(got, mine, group=self.group)
        self._sent(mine, self.nbands - 1)
        lv = act.level
        rows = [t[:, :, :b - a] for t, (a, b) in zip(got, zip(lv.edges[:-1], lv.edges[1:]))]
        return torch.cat(rows, dim=2).contiguous(memory_format=memory_format(act.parts[self.rank]))

    def output(self, act, gather):
        if gather == "all":
            return self.whole(act)
        dst, lv = int(gather), act.level
        part = act.parts[self.rank]
        if self.rank != dst:
            self.dist.send(part.contiguous(), self._peer(dst), group=self.group)
            self._sent(part)
            return None
        n, c, _, w = part.shape
        out = torch.empty((n, c, lv.height, w), dtype=part.dtype, device=part.device)
        for r in range(self.nbands):
            a, b = lv.rows(r)
            if r == dst:
                out[:, :, a:b].copy_(part)
            else:
                buf = torch.empty((n, c, b - a, w), dtype=part.dtype, device=part.device)
                self.dist.recv(buf, self._peer(r), group=self.group)
                out[:, :, a:b].copy_(buf)
        return out.contiguous(memory_format=memory_format(part))
