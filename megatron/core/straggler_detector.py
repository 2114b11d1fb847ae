"""megatron-core's ``StragglerDetector`` (exported from :mod:`megatron.core.utils`): a per-process singleton that
times chosen regions of every rank and, at each report, names the slowest and fastest ranks.

Use::

    stimer = StragglerDetector()
    stimer.configure(world, rank, mmcnt=1, enabled=True)   # once per process
    with stimer:                 # a compute region (forward step): summed into this interval's time
        ...
    with stimer(bdata=True):     # a data region (get_batch): the longest one counts
        ...
    stimer.report(total_flops, log_interval)   # every rank; rank 0 logs

Per interval of ``log_interval`` iterations, each rank's time per iteration is ``ptime = sum(compute regions) /
log_interval`` (ms) and its estimated throughput ``flops / log_interval / (ptime * 1e9 * world) / amp`` TFLOP/s
(``amp`` = 3 when only forward regions are timed: backward costs about twice the forward). ``report`` gathers
every rank's numbers to rank 0 (``gather_object``), which logs the min / max time, data time, GPU temperature,
power, utilisation and clock with their ranks, the min / max throughput, and with ``mmcnt > 1`` the ``mmcnt``
slowest and fastest ranks. Each report ends with :meth:`_check_toggle`, which broadcasts rank 0's on / off state.

A region's time is the host's ``perf_counter`` span, and on CUDA the larger of that and the span of CUDA events
recorded at its ends (megatron-core's rule). Differences from megatron-core, said plainly: megatron-core runs only
with CUDA (elsewhere it stays off); here it also times CPU runs (the GPU metrics are then 0). Its HTTP control
server (``--straggler-ctrlr-port``) is not part of this library: ``port`` is accepted and unused; the state still
toggles by setting ``toggle = True`` on rank 0 (taking effect at the next report).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import List, Optional

import torch

logger = logging.getLogger(__name__)

_METRICS = (("elapsed", "time", "ms"), ("btime", "btime", "ms"), ("temp", "temp", "C"), ("power", "power", "W"),
            ("util", "util", "%"), ("clock", "clock", "MHz"))


class _ValueWithRank:
    """A value with the rank it came from and its unit; ``str``: ``"<value:.2f><unit>/<rank>"``."""

    def __init__(self, value: float, rank: int, unit: str = "") -> None:
        self._value, self._rank, self._unit = value, rank, unit

    def __lt__(self, other) -> bool:
        return self._value < other._value

    def __gt__(self, other) -> bool:
        return self._value > other._value

    def __call__(self):
        return self._value, self._rank, self._unit

    def __str__(self) -> str:
        return f"{self._value:.2f}{self._unit}/{self._rank}"


@dataclass
class _StragglerData:
    """Rank 0's view of one report: min / max of each metric with its rank, and every rank's throughput sorted."""

    min_elapsed: _ValueWithRank = None
    max_elapsed: _ValueWithRank = None
    min_btime: _ValueWithRank = None
    max_btime: _ValueWithRank = None
    min_temp: _ValueWithRank = None
    max_temp: _ValueWithRank = None
    min_power: _ValueWithRank = None
    max_power: _ValueWithRank = None
    min_util: _ValueWithRank = None
    max_util: _ValueWithRank = None
    min_clock: _ValueWithRank = None
    max_clock: _ValueWithRank = None
    aflops: Optional[List[_ValueWithRank]] = None


class _Region:
    """One timed region: host start / stop (ns) and, on CUDA, two timing events."""

    def __init__(self, on_cuda: bool):
        self.start_ns, self.stop_ns = time.perf_counter_ns(), 0
        self.events = None
        if on_cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def stop(self) -> None:
        self.stop_ns = time.perf_counter_ns()
        if self.events is not None:
            self.events[1].record()

    def milliseconds(self) -> float:
        host = (self.stop_ns - self.start_ns) / 1e6
        return host if self.events is None else max(host, self.events[0].elapsed_time(self.events[1]))


class StragglerDetector:
    """The process's straggler detector (module docstring); ``StragglerDetector()`` always returns the one
    instance. Disabled (``start`` / ``stop`` do nothing) until :meth:`configure` with ``enabled=True``."""

    _configured = False

    def __new__(cls):
        if not hasattr(cls, "_instance"):
            cls._instance = super().__new__(cls)
        return cls._instance

    def __init__(self) -> None:
        self._off = True
        self.start = self.null_method
        self.stop = self.null_method
        self.world, self.rank, self.mmcnt, self.port, self.amp = 0, 0, 1, 0, 3.0
        self.toggle = False
        self.bdata = False
        self.dev = None
        self._gemm: List[_Region] = []
        self._data: List[_Region] = []

    def configure(self, world: int, rank: int, mmcnt: int = 1, amp: float = 3.0, port: int = 65535,
                  prefill: int = 1024, enabled: bool = False) -> None:
        """Set up the detector once per process (later calls do nothing): ``world`` ranks, this ``rank``, ``mmcnt``
        slowest / fastest ranks listed, ``amp`` (module docstring), collection on when ``enabled``. ``port`` (the
        control server) and ``prefill`` (pre-allocated CUDA events) are accepted for megatron-core's signature."""
        if StragglerDetector._configured:
            return
        StragglerDetector._configured = True
        self.world, self.rank, self.mmcnt, self.amp, self.port = world, rank, max(mmcnt, 1), amp, port
        self.toggle = self.bdata = False
        self._gemm, self._data = [], []
        on_nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
        self.dev = torch.cuda.current_device() if on_nccl else torch.device("cpu")
        self._set_state(off=not enabled)

    def _set_state(self, off: bool) -> None:
        self._off = off
        self.start = self.null_method if off else self.start_method
        self.stop = self.null_method if off else self.stop_method

    def reset(self) -> None:
        """Forget the regions timed since the last report."""
        if self._off:
            return
        self._gemm, self._data = [], []
        self.bdata = False

    def start_method(self) -> None:
        """Open a region: a data region when the instance was called with ``bdata=True``, else a compute one."""
        region = _Region(torch.cuda.is_available() and self.dev != torch.device("cpu"))
        (self._data if self.bdata else self._gemm).append(region)
        self.bdata = False

    def stop_method(self) -> None:
        """Close the open region (the latest data region if it is open, else the latest compute region)."""
        for regions in (self._data, self._gemm):
            if regions and regions[-1].stop_ns == 0:
                regions[-1].stop()
                return

    def elapsed(self):
        """``(compute ms summed, longest data region ms, GPU temperature, power, utilisation, clock)`` since the
        last reset, then reset; zeros when off. Regions left open are reported as out of sync (and skipped)."""
        if self._off:
            return 0, 0, 0, 0, 0, 0
        delta = batch_delta = 0.0
        temp = power = util = clock = 0
        if any(r.stop_ns == 0 for r in self._gemm):
            logger.warning("StragglerDetector: a timed region was started and not stopped")
        elif any(r.stop_ns == 0 for r in self._data):
            logger.warning("StragglerDetector: a get_batch region was started and not stopped")
        else:
            if self.dev != torch.device("cpu"):
                temp, power = torch.cuda.temperature(), torch.cuda.power_draw()
                util, clock = torch.cuda.utilization(), torch.cuda.clock_rate()
                torch.cuda.synchronize()
            delta = sum(r.milliseconds() for r in self._gemm)
            batch_delta = max((r.milliseconds() for r in self._data), default=0.0)
        self.reset()
        return delta, batch_delta, temp, power, util, clock

    def report(self, total_flops: float = 0.0, log_interval: int = 0) -> bool:
        """Every rank calls it; rank 0 logs the interval's min / max (module docstring). Returns whether a report
        was made (on, ``total_flops > 0`` and ``log_interval > 0``). Ends with :meth:`_check_toggle`."""
        reported = False
        if not self._off and total_flops > 0.0 and log_interval > 0:
            elapsed, btime, temp, power, util, clock = self.elapsed()
            ptime = elapsed / log_interval
            # (no timed region in the interval: no throughput, where megatron-core divides by zero)
            flops = total_flops / log_interval / (ptime * 10**9 * self.world) / self.amp if ptime > 0 else 0.0
            data = self._min_max(ptime, btime, float(temp), float(power), float(util), float(clock), flops)
            if self.rank == 0 and data is not None and data.aflops is not None:
                now = f"[{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
                min_flops, min_rank, _ = data.aflops[0]()
                max_flops, max_rank, _ = data.aflops[-1]()
                parts = [f"{now}"]
                for label, attr in (("Rtt", "elapsed"), ("Pwr", "power"), ("Tmp", "temp"), ("Utl", "util"),
                                    ("Clk", "clock"), ("DRtt", "btime")):
                    parts += [f"Mn{label}/Rnk: {getattr(data, 'min_' + attr)}",
                              f"Mx{label}/Rnk: {getattr(data, 'max_' + attr)}"]
                parts += [f"MnEtpt/Rnk: {min_flops:.2f}TF/{min_rank}", f"MxEtpt/Rnk: {max_flops:.2f}TF/{max_rank}"]
                logger.info(" | ".join(parts))
                if 1 < self.mmcnt < self.world:
                    logger.info(f"^^^^ Bottom {self.mmcnt} Ranks with lowest  Etpt(TF):"
                                + "".join(f" {v}," for v in data.aflops[:self.mmcnt]))
                    logger.info(f"^^^^ Top    {self.mmcnt} Ranks with highest Etpt(TF):"
                                + "".join(f" {v}," for v in data.aflops[self.world - self.mmcnt:]))
                reported = True
        self._check_toggle()
        return reported

    def _check_toggle(self) -> None:
        """Apply rank 0's state on every rank (one broadcast): rank 0 flips it when ``toggle`` was set."""
        off = self._off
        if self.rank == 0 and self.toggle:
            off, self.toggle = not off, False
        state = torch.tensor(off, dtype=torch.bool, device=self.dev)
        torch.distributed.broadcast(state, 0)
        if bool(state.item()) != self._off:
            self._set_state(bool(state.item()))
            if self.rank == 0:
                logger.info(f"Toggling StragglerDetector State {'OFF' if self._off else 'ON'}")

    def _min_max(self, ptime, btime, temp, power, util, clock, flops) -> Optional[_StragglerData]:
        """Gather every rank's numbers on rank 0 and find each metric's min / max rank (None when off)."""
        if self._off:
            return None
        mine = dict(rank=self.rank, time=ptime, btime=btime, temp=temp, power=power, util=util, clock=clock,
                    flops=flops)
        gathered = [mine] * self.world if self.rank == 0 else None
        torch.distributed.gather_object(mine, object_gather_list=gathered, dst=0)
        out = _StragglerData()
        if self.rank == 0:
            for attr, key, unit in _METRICS:
                low, high = min(gathered, key=lambda d: d[key]), max(gathered, key=lambda d: d[key])
                setattr(out, "min_" + attr, _ValueWithRank(low[key], int(low["rank"]), unit))
                setattr(out, "max_" + attr, _ValueWithRank(high[key], int(high["rank"]), unit))
            out.aflops = sorted((_ValueWithRank(d.get("flops", 0.0), int(d.get("rank", -1))) for d in gathered),
                                key=lambda v: v()[0])
        torch.distributed.barrier()
        return out

    @property
    def enabled(self) -> bool:
        """Whether regions are timed now."""
        return not self._off

    @property
    def configured(self) -> bool:
        """Whether :meth:`configure` ran in this process."""
        return StragglerDetector._configured

    @property
    def my_rank(self) -> int:
        return self.rank

    @property
    def world_size(self) -> int:
        return self.world

    def null_method(self) -> None:
        """What ``start`` / ``stop`` are while off."""

    def __enter__(self) -> "StragglerDetector":
        self.start()
        return self

    def __call__(self, bdata: bool = False) -> "StragglerDetector":
        """``with detector(bdata=True):`` times a data region instead of a compute one."""
        self.bdata = bdata
        return self

    def __exit__(self, ex_type, ex_val, ex_tb) -> bool:
        """Stop the region; an exception raised inside it is logged and re-raised."""
        if ex_type is not None:
            logger.warning(f"StragglerDetector: {ex_type.__name__} raised inside a timed region: {ex_val}")
        self.stop()
        return False


__all__ = ["StragglerDetector"]
