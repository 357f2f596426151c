"""How long one call takes: many samples within a time budget, median and spread.

On CUDA each sample is bracketed by CUDA events with the L2 cache flushed before it (a 256 MB
buffer zeroed, as ``triton.testing.do_bench`` does), so a kernel is not timed on a warm cache its
real callers would not have. On the CPU each sample is ``perf_counter`` around the call, run on
one thread: measured on a shared 2-core machine, unchanged torch ops timed with 2 threads drifted
1.2 to 2.9 x between runs (a 2 x 32768 softmax: 46 to 134 us), single-threaded within about 5 %
(69 to 73 us). The gate needs the second; parallel scaling is not what it guards. Even so, whole
stretches of a run on a shared machine went 1.4 to 1.9 x slower for every op at once; a fixed
calibration workload interleaved with the calls (once every third call) sees the same stretch,
and the gate judges the call's time both on the clock and relative to it (see ``speed.gate``).

Warm-up and measurement are time budgets, not repetition counts: a 10 us call gets hundreds of
samples and a 50 ms call a handful, for the same cost.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, ContextManager

import torch

__all__ = ["Bench", "Timing", "SamplingPlan", "format_seconds", "CPU_PLAN", "CUDA_PLAN", "measure", "synchronized_perf_counter"]

_L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Bench:
    """What is timed: ``fn()``, called inside ``context()``, which is entered once around the
    warm-up and all samples. Config set-up (autocast, TF32 flags, the SDPA backend) belongs in the
    context: entering it costs microseconds, as much as a small kernel, and would dilute in each
    sample the slowdown the gate is looking for."""
    fn: Callable[[], object]
    context: Callable[[], ContextManager] = contextlib.nullcontext

    def __call__(self):
        with self.context():
            return self.fn()


@dataclass(frozen=True)
class SamplingPlan:
    """How long to warm up and to sample (seconds), and the fewest and most samples to take."""

    warmup_s: float
    measure_s: float
    min_samples: int
    max_samples: int


# Small on the CPU so that timing every case of the default suite stays cheap (about a fifth of its
# wall time); the gate's bootstrap interval says when so few samples are too noisy to judge.
CPU_PLAN = SamplingPlan(warmup_s=0.001, measure_s=0.004, min_samples=15, max_samples=300)
CUDA_PLAN = SamplingPlan(warmup_s=0.025, measure_s=0.1, min_samples=20, max_samples=1000)


@dataclass(frozen=True)
class Timing:
    samples: tuple[float, ...]  # seconds per call
    # CPU: a fixed workload timed in alternation with the call, so the gate can divide out what
    # slowed the whole machine while the case ran (a neighbour, frequency); empty on CUDA
    calibration: tuple[float, ...] = ()
    # CPU, Linux: cores' worth of CPU time other processes used over the last second or so (a busy
    # neighbour); None where the system does not say or too little time has passed to tell
    neighbour_load: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: the run's own noise, relative."""
        if len(self.samples) < 4:
            return 0.0
        q = statistics.quantiles(self.samples, n=4)
        return (q[2] - q[0]) / self.median if self.median > 0 else 0.0

    def describe(self) -> str:
        return f"median {format_seconds(self.median)} over {len(self.samples)} calls (IQR {100 * self.spread:.0f} %)"


def format_seconds(s: float) -> str:
    for unit, f in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if s * f >= 1.0:
            return f"{s * f:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def measure(bench: Bench | Callable[[], object], device: str, plan: SamplingPlan | None = None) -> Timing:
    """Time ``bench`` (a Bench, or a plain callable) on ``device``: warm-up, then samples until the
    plan's time is spent."""
    if not isinstance(bench, Bench):
        bench = Bench(bench)
    with bench.context():
        if device.startswith("cuda"):
            return _measure_cuda(bench.fn, plan or CUDA_PLAN)
        return _measure_cpu(bench.fn, plan or CPU_PLAN)


def _measure_cpu(fn, plan: SamplingPlan) -> Timing:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timing = _sample_cpu(fn, plan)
    finally:
        torch.set_num_threads(threads)
    return replace(timing, neighbour_load=NEIGHBOURS.load())


class NeighbourLoad:
    """How many cores' worth of CPU other processes used over the last ``window_s`` seconds or
    more: the system's CPU time (/proc/stat, in 10 ms ticks, so a window far longer than one
    case's few milliseconds of samples) less this process's own."""

    def __init__(self, window_s: float = 1.0):
        self.window_s = window_s
        self.history: deque = deque()

    def load(self) -> float | None:
        total = _cpu_seconds()
        if total is None:
            return None
        now = (time.perf_counter(), total, time.process_time())
        self.history.append(now)
        while len(self.history) > 2 and self.history[1][0] <= now[0] - self.window_s:
            self.history.popleft()
        first = self.history[0]
        wall = now[0] - first[0]
        if wall < self.window_s / 2:
            return None  # too short to tell yet
        return max(0.0, (now[1] - first[1]) - (now[2] - first[2])) / wall


NEIGHBOURS = NeighbourLoad()

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


CGROUP = "/sys/fs/cgroup"  # cgroup v2: cpu.max ("<quota> <period>" or "max <period>"), cpu.stat (usage_usec)
PROC_SELF_CGROUP = "/proc/self/cgroup"  # "0::<path>": this process's cgroup under CGROUP


@dataclass(frozen=True)
class CpuQuota:
    cores: float  # the CPUs the quota allows (1.5 for "150000 100000")
    where: str  # the cgroup directory that sets it: its cpu.stat counts what shares it


def cgroup_quota() -> CpuQuota | None:
    """The smallest cgroup v2 CPU quota on this process's cgroup and its ancestors (a container's,
    a systemd unit's CPUQuota, a scheduler's job), or None without one."""
    try:
        with open(PROC_SELF_CGROUP, encoding="ascii") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    quota = None
    path = own
    while True:
        where = os.path.normpath(os.path.join(CGROUP, path.lstrip("/")))
        try:
            with open(os.path.join(where, "cpu.max"), encoding="ascii") as f:
                limit, period = f.read().split()[:2]
            if limit != "max" and (quota is None or int(limit) / int(period) < quota.cores):
                quota = CpuQuota(int(limit) / int(period), where)
        except (OSError, ValueError):
            pass
        if path in ("/", ""):
            return quota
        path = os.path.dirname(path.rstrip("/")) or "/"


@functools.lru_cache(maxsize=None)
def _cgroup_cpu_stat() -> str | None:
    """The cpu.stat _cpu_seconds reads under a quota, chosen once: a load is a difference of one counter."""
    quota = cgroup_quota()
    return None if quota is None else os.path.join(quota.where, "cpu.stat")



def _cpu_seconds() -> float | None:
    """CPU seconds all processes have used since boot (Linux /proc/stat: user, nice, system, irq,
    softirq, steal), or None elsewhere. Under a CPU quota, those of the cgroup that sets it
    (cpu.stat): /proc/stat there counts the whole host's tenants, who share none of its quota."""
    stat = _cgroup_cpu_stat()
    if stat is not None:
        try:
            with open(stat, encoding="ascii") as f:
                for line in f:
                    key, value = line.split()[:2]
                    if key == "usage_usec":
                        return int(value) / 1e6
        except (OSError, ValueError):
            pass
        return None
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS


_CAL_X = torch.randn(1 << 12, generator=torch.Generator().manual_seed(1))
_CAL_Y = torch.randn(1 << 10, generator=torch.Generator().manual_seed(2))


_CAL_EVERY = 3  # calls per calibration sample: enough to follow the machine, most time to the call


def _calibration() -> None:
    """A few us on one core: an exp over 16 KB and a sine, so that most of the time goes to the
    call's own samples. Neither op is on an autocast list: the workload is the same inside every
    config's context."""
    torch.exp(_CAL_X)
    torch.sin(_CAL_Y)


def _sample_cpu(fn, plan: SamplingPlan) -> Timing:
    clock = time.perf_counter
    end = clock() + plan.warmup_s
    fn()
    _calibration()
    while clock() < end:
        fn()
        _calibration()
    samples, cal = [], []
    end = clock() + plan.measure_s
    while len(samples) < plan.max_samples and (len(samples) < plan.min_samples or clock() < end):
        t0 = clock()
        fn()
        t1 = clock()
        samples.append(t1 - t0)
        if len(samples) % _CAL_EVERY == 1:
            _calibration()
            cal.append(clock() - t1)
    return Timing(tuple(samples), tuple(cal))


def _measure_cuda(fn, plan: SamplingPlan) -> Timing:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    end = time.perf_counter() + plan.warmup_s
    while time.perf_counter() < end:
        fn()
        torch.cuda.synchronize()
    samples = []
    end = time.perf_counter() + plan.measure_s
    while len(samples) < plan.max_samples and (len(samples) < plan.min_samples or time.perf_counter() < end):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / 1e3)
    return Timing(tuple(samples))


def synchronized_perf_counter() -> float:
    """``time.perf_counter`` after the GPU has finished its queued work: a correct timer for
    pytest-benchmark on CUDA code (``--benchmark-timer=pytest_precision.speed.timing.synchronized_perf_counter``),
    whose default timer reads the clock when the kernel is launched, not when it has run."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()
