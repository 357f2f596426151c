"""Error statistics of ``out`` against ``ref`` in one pass: a Triton kernel and its torch twin.

Everything the core comparison (``pytest_precision.numerics.metrics``) needs besides the worst elements and
the exact p99: ULPs in the dtype under test (the same piecewise-linear ordinal as
``formats.ulp_distance``, in float64, so the numbers are identical), their maximum and where, their
sum and a histogram in power-of-two buckets, max abs and max rel error, the sums SQNR and cosine
are made of, and the overflow / underflow / NaN / missing-NaN / flushed-subnormal counts, under
the same rules as ``metrics.compare``.

Histogram buckets: 0 holds ULP 0; 1 holds (0, 1]; b in 2..62 holds (2^(b-2), 2^(b-1)]; 62 also
holds everything larger but finite; 63 holds the infinite distances (a NaN or inf facing anything else).

Each program reduces ``ITERS`` blocks and writes its partial results; torch combines the partials
(in float64, deterministic: no float atomics). On CUDA ``compare`` uses the kernel once it is
installed (``install()``, which the plugin calls on CUDA runs); ``error_statistics_torch`` computes the same fields with torch ops (and is what the
kernel is tested against, on CPU under the interpreter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pytest_precision.numerics.formats import format_of, ulp_distance

__all__ = ["ErrorStatistics", "Partials", "error_statistics", "error_statistics_torch", "launch_statistics", "combine",
           "install", "BUCKETS", "KERNEL_DTYPES"]

BUCKETS = 64
# ULP dtypes the kernel counts in; float64 ULPs need more than float64 arithmetic (the torch path has them)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class ErrorStatistics:
    numel: int
    n_finite: int  # elements finite in both out and ref
    max_ulp: float
    argmax_ulp: int  # flat index of the first element with max_ulp
    sum_ulp: float  # over the elements finite on both sides
    histogram: torch.Tensor  # int64 (BUCKETS,)
    max_abs: float
    max_rel: float
    sum_sq_err: float
    sum_sq_ref: float
    sum_sq_out: float
    sum_out_ref: float
    overflow: int
    underflow: int
    nan: int
    missing_nan: int
    flushed_subnormal: int

    @property
    def mean_ulp(self) -> float:
        return self.sum_ulp / self.n_finite if self.n_finite else 0.0

    def quantile_bound(self, q: float) -> float:
        """An upper bound of the q-quantile of the finite ULPs: the top of the bucket holding it."""
        finite = self.histogram[:-1]
        total = int(finite.sum())
        if total == 0:
            return 0.0
        rank = math.ceil(q * total)
        b = int(torch.searchsorted(finite.cumsum(0), torch.tensor(rank)))
        return 0.0 if b == 0 else (math.inf if b >= BUCKETS - 2 else 2.0 ** (b - 1))


def buckets_torch(ulps: torch.Tensor) -> torch.Tensor:
    """The histogram bucket of each ULP distance (module doc)."""
    mant, ex = torch.frexp(ulps)  # u = mant * 2^ex, mant in [0.5, 1): ceil(log2 u) = ex - (mant == 0.5)
    ceil_log2 = ex.to(torch.int64) - (mant == 0.5).to(torch.int64)
    b = (ceil_log2 + 1).clamp(1, BUCKETS - 2)
    b = torch.where(ulps == 0, torch.zeros_like(b), b)
    return torch.where(torch.isinf(ulps), torch.full_like(b, BUCKETS - 1), b)


def error_statistics_torch(out, ref, dtype=None, *, scale: float = 1.0, log_domain: bool = False,
                           underflow_floor: float = 0.0) -> ErrorStatistics:
    """The statistics with torch ops (several passes), the rules of ``metrics.compare``."""
    dtype = dtype or out.dtype
    fmt = format_of(dtype)
    o = out.detach().to(torch.float64).flatten()
    r = ref.detach().to(device=o.device, dtype=torch.float64).flatten()
    os_, rs = o / scale, r / scale
    ulps = ulp_distance(os_, rs, dtype, log_domain=log_domain)
    o_nan, r_nan, r_fin = torch.isnan(o), torch.isnan(r), torch.isfinite(r)
    if log_domain:
        overflow = (o == math.inf) & r_fin
        underflow = (o == -math.inf) & r_fin
    else:
        overflow = torch.isinf(o) & r_fin
        if not fmt.has_inf:
            overflow |= (os_.abs() >= fmt.max) & (rs.abs() > fmt.max) & r_fin
        underflow = (o == 0) & (rs.abs() >= max(fmt.smallest_normal, underflow_floor / scale)) & r_fin
    flushed = (o == 0) & (rs.abs() > fmt.smallest_subnormal / 2) & (rs.abs() < fmt.smallest_normal)
    both = torch.isfinite(o) & r_fin
    fo, fr, fu = o[both], r[both], ulps[both]
    diff = (fo - fr).abs()
    big = fr.abs() >= fmt.smallest_normal * scale
    n = ulps.numel()
    return ErrorStatistics(
        numel=n, n_finite=int(both.sum()),
        max_ulp=float(ulps.max()) if n else 0.0,
        argmax_ulp=int(torch.argmax(ulps)) if n else 0,
        sum_ulp=float(fu.sum()),
        histogram=torch.bincount(buckets_torch(ulps).cpu(), minlength=BUCKETS),
        max_abs=float(diff.max()) if diff.numel() else 0.0,
        max_rel=float((diff[big] / fr[big].abs()).max()) if bool(big.any()) else 0.0,
        sum_sq_err=float(((fo - fr) ** 2).sum()), sum_sq_ref=float((fr * fr).sum()),
        sum_sq_out=float((fo * fo).sum()), sum_out_ref=float((fo * fr).sum()),
        overflow=int(overflow.sum()), underflow=int(underflow.sum()),
        nan=int((o_nan & ~r_nan).sum()), missing_nan=int((r_nan & ~o_nan).sum()),
        flushed_subnormal=int(flushed.sum()),
    )


# ---------------------------------------------------------------- the kernel (needs triton)

# Each program reduces ITERS blocks of BLOCK elements in two stages: every lane (VEC elements per
# thread) keeps its own accumulators over the blocks, reduced across lanes once at the end, and the
# programs' partial results are combined in torch. Per element slot a thread keeps 5 float64 sums,
# 2 float64 maxima, its largest ULP and the block it was in, and one int32 of six counts packed
# in 5-bit fields (so ITERS <= 31): 19 registers, few enough at VEC = 4 for ptxas not to spill
# (the compile check holds it to that).
COUNT_BITS = 5
MAX_ITERS = 2**COUNT_BITS - 1
VEC, WARPS, ITERS = 2, 8, 16  # on a GPU: blocks of 512, 8192 elements per program

try:  # the torch path above is importable without triton (metrics imports this module on CUDA only)
    import triton.language as tl
except ImportError:
    tl = None

if tl is not None:
    def _error_statistics_kernel(out_ptr, ref_ptr, ints_ptr, floats_ptr, hist_ptr, n, inv_scale, rel_floor,
                                 underflow_at, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                                 FMAX: tl.constexpr, SMALLEST_NORMAL: tl.constexpr,
                                 HALF_SUBNORMAL: tl.constexpr, HAS_INF: tl.constexpr, LOG_DOMAIN: tl.constexpr,
                                 BLOCK: tl.constexpr, ITERS: tl.constexpr, NB: tl.constexpr,
                                 COUNT_BITS: tl.constexpr):
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        first = pid.to(tl.int64) * ITERS * BLOCK
        inf = float("inf")
        best = tl.full([BLOCK], -1.0, tl.float64)  # this lane's largest ULP so far, and its block
        best_it = tl.zeros([BLOCK], tl.int32)
        sum_ulp = tl.zeros([BLOCK], tl.float64)
        max_abs = tl.zeros([BLOCK], tl.float64)
        max_rel = tl.zeros([BLOCK], tl.float64)
        sse = tl.zeros([BLOCK], tl.float64)
        ssr = tl.zeros([BLOCK], tl.float64)
        sso = tl.zeros([BLOCK], tl.float64)
        sor = tl.zeros([BLOCK], tl.float64)
        counts = tl.zeros([BLOCK], tl.int32)  # finite, overflow, underflow, NaN, missing NaN, flushed
        hist = tl.zeros([NB], tl.int32)
        for it in range(ITERS):
            idx = first + it * BLOCK + lanes
            inside = idx < n
            o = tl.load(out_ptr + idx, mask=inside, other=0.0).to(tl.float64)
            r = tl.load(ref_ptr + idx, mask=inside, other=0.0).to(tl.float64)
            os_ = o * inv_scale  # inv_scale is a power of two: exact, as compare's division
            rs = r * inv_scale
            # ordinal of each side: hi = binade above EMIN, lo = |x| / spacing (exact power-of-two scaling)
            a_o = tl.abs(os_)
            a_r = tl.abs(rs)
            e_o = tl.minimum(tl.maximum(((a_o.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023, EMIN), EMAX)
            e_r = tl.minimum(tl.maximum(((a_r.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023, EMIN), EMAX)
            sg_o = tl.where(os_ < 0, -1, 1)
            sg_r = tl.where(rs < 0, -1, 1)
            hi_o = tl.where(a_o == 0, 0, (e_o - EMIN) * sg_o)
            hi_r = tl.where(a_r == 0, 0, (e_r - EMIN) * sg_r)
            step_o = ((MANT - e_o + 1023) << 52).to(tl.float64, bitcast=True)  # 2^(MANT - e), exact
            step_r = ((MANT - e_r + 1023) << 52).to(tl.float64, bitcast=True)
            lo_o = tl.where(a_o == 0, 0.0, a_o * step_o * sg_o.to(tl.float64))
            lo_r = tl.where(a_r == 0, 0.0, a_r * step_r * sg_r.to(tl.float64))
            dist = tl.abs((hi_o - hi_r).to(tl.float64) * (2.0 ** MANT) + (lo_o - lo_r))
            if LOG_DOMAIN:  # log-probabilities in (-1, 1): steps at 1.0 (formats.ulp_distance)
                dist = tl.where(a_r < 1.0, tl.abs(os_ - rs) * (2.0 ** MANT), dist)
            o_nan = o != o
            r_nan = r != r
            o_fin = (~o_nan) & (tl.abs(o) != inf)
            r_fin = (~r_nan) & (tl.abs(r) != inf)
            both = o_fin & r_fin & inside
            same_special = (o_nan & r_nan) | ((tl.abs(o) == inf) & (o == r))
            ulp = tl.where(o_fin & r_fin, dist, tl.where(same_special, 0.0, inf))
            ulp = tl.where(inside, ulp, -1.0)
            grows = ulp > best  # strictly: a lane keeps the first block holding its maximum
            best = tl.where(grows, ulp, best)
            best_it = tl.where(grows, it, best_it)
            # histogram bucket: ceil(log2 u) from the bits of u; lanes past n land in bucket 0 and
            # are taken out of it when the partials are combined
            ub = ulp.to(tl.int64, bitcast=True)
            ceil_log2 = ((ub >> 52) & 0x7FF) - 1023 + ((ub & 0xFFFFFFFFFFFFF) != 0).to(tl.int64)
            bucket = tl.minimum(tl.maximum(ceil_log2 + 1, 1), NB - 2)
            bucket = tl.where(ulp == 0, 0, bucket)
            bucket = tl.where(ulp == inf, NB - 1, bucket)
            bucket = tl.where(inside, bucket, 0)
            hist += tl.histogram(bucket.to(tl.int32), NB)

            fo = tl.where(both, o, 0.0)
            fr = tl.where(both, r, 0.0)
            diff = tl.abs(fo - fr)
            sum_ulp += tl.where(both, ulp, 0.0)
            max_abs = tl.maximum(max_abs, diff)
            big = both & (tl.abs(fr) >= rel_floor)
            max_rel = tl.maximum(max_rel, tl.where(big, diff / tl.where(big, tl.abs(fr), 1.0), 0.0))
            sse += (fo - fr) * (fo - fr)
            ssr += fr * fr
            sso += fo * fo
            sor += fo * fr
            r_fin_in = r_fin & inside
            if LOG_DOMAIN:
                over = (o == inf) & r_fin_in
                under = (o == -inf) & r_fin_in
            else:
                over = (tl.abs(o) == inf) & r_fin_in
                if not HAS_INF:  # saturating format: clipped at max while the true value lies beyond
                    over = over | ((a_o >= FMAX) & (a_r > FMAX) & r_fin_in)
                under = (o == 0) & (a_r >= underflow_at) & r_fin_in
            flushed = (o == 0) & (a_r > HALF_SUBNORMAL) & (a_r < SMALLEST_NORMAL) & inside
            counts += (both.to(tl.int32) | (over.to(tl.int32) << COUNT_BITS)
                       | (under.to(tl.int32) << (2 * COUNT_BITS)) | ((o_nan & (~r_nan) & inside).to(tl.int32) << (3 * COUNT_BITS))
                       | ((r_nan & (~o_nan) & inside).to(tl.int32) << (4 * COUNT_BITS))
                       | (flushed.to(tl.int32) << (5 * COUNT_BITS)))
        # second stage inside the program: across lanes, once
        top = tl.max(best, 0)
        at = first + best_it.to(tl.int64) * BLOCK + lanes
        top_at = tl.min(tl.where(best == top, at, first + ITERS * BLOCK), 0)  # the first index holding it
        ints = ints_ptr + pid.to(tl.int64) * 8
        field = (1 << COUNT_BITS) - 1
        for k in tl.static_range(6):
            tl.store(ints + k, tl.sum(((counts >> (k * COUNT_BITS)) & field).to(tl.int64), 0))
        tl.store(ints + 6, top_at)
        floats = floats_ptr + pid.to(tl.int64) * 8
        tl.store(floats + 0, top)
        tl.store(floats + 1, tl.sum(sum_ulp, 0))
        tl.store(floats + 2, tl.max(max_abs, 0))
        tl.store(floats + 3, tl.max(max_rel, 0))
        tl.store(floats + 4, tl.sum(sse, 0))
        tl.store(floats + 5, tl.sum(ssr, 0))
        tl.store(floats + 6, tl.sum(sso, 0))
        tl.store(floats + 7, tl.sum(sor, 0))
        tl.store(hist_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), hist)

    from pytest_precision.kernels.runtime import LazyKernel

    error_statistics_kernel = LazyKernel(_error_statistics_kernel)

# fp8 widened before the kernel: e4m3 is no type the kernel can load on sm_80, and every value of
# both fp8 formats is exact in fp16 (one pass over the output, 1 byte read and 2 written per element)
_WIDENED = {torch.float8_e4m3fn: torch.float16, torch.float8_e5m2: torch.float16}


@dataclass
class Partials:
    """What the kernel's programs wrote, before ``combine``."""

    ints: torch.Tensor  # int64 (programs, 8)
    floats: torch.Tensor  # float64 (programs, 8)
    hist: torch.Tensor  # int32 (programs, BUCKETS)
    numel: int
    padded: int  # lanes past the end, counted in bucket 0


def launch_statistics(out, ref, dtype=None, *, scale: float = 1.0, log_domain: bool = False,
                      underflow_floor: float = 0.0, block: int | None = None, iters: int | None = None) -> Partials:
    """Launch the kernel (the first stage): each program's partial results, not yet combined.
    ``scale`` must be a power of two (fp8's per-tensor scales are)."""
    from pytest_precision.kernels.runtime import boundary_dtype, interpreting

    dtype = dtype or out.dtype
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"error_statistics: ULPs of {dtype} need the torch path (kernel: {KERNEL_DTYPES})")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: output {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    if scale <= 0 or math.frexp(scale)[0] != 0.5:
        raise ValueError(f"error_statistics: scale must be a power of two, got {scale}")
    if out.device.type == "cpu" and not interpreting():
        raise RuntimeError("error_statistics: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    if block is None:
        block, iters = (1024, 1) if interpreting() else (VEC * 32 * WARPS, ITERS)
    iters = iters or 1
    if not 1 <= iters <= MAX_ITERS:
        raise ValueError(f"error_statistics: iters must be 1 to {MAX_ITERS} (counts are packed in {COUNT_BITS} bits)")
    fmt = format_of(dtype)
    o = out.detach().flatten().contiguous()
    o = o.to(_WIDENED.get(o.dtype, o.dtype))
    o = o.to(boundary_dtype(o.dtype))  # bf16 crosses as fp32 under the interpreter (runtime.py)
    r = ref.detach().to(o.device).flatten().contiguous()
    r = r.to(_WIDENED.get(r.dtype, r.dtype))
    r = r.to(boundary_dtype(r.dtype))
    n = o.numel()
    programs = max(1, -(-n // (block * iters)))
    ints = torch.zeros(programs, 8, dtype=torch.int64, device=o.device)
    floats = torch.zeros(programs, 8, dtype=torch.float64, device=o.device)
    hist = torch.zeros(programs, BUCKETS, dtype=torch.int32, device=o.device)
    warps = max(1, min(8, block // (32 * VEC)))
    error_statistics_kernel[(programs,)](
        o, r, ints, floats, hist, n, 1.0 / scale, fmt.smallest_normal * scale,
        max(fmt.smallest_normal, underflow_floor / scale),
        MANT=fmt.mantissa_bits, EMIN=fmt.emin, EMAX=fmt.emax, FMAX=fmt.max, SMALLEST_NORMAL=fmt.smallest_normal,
        HALF_SUBNORMAL=fmt.smallest_subnormal / 2, HAS_INF=fmt.has_inf, LOG_DOMAIN=bool(log_domain),
        BLOCK=block, ITERS=iters, NB=BUCKETS, COUNT_BITS=COUNT_BITS, num_warps=warps)
    return Partials(ints, floats, hist, n, programs * iters * block - n)


def combine(p: Partials) -> ErrorStatistics:
    """The second stage: the programs' partial results into the statistics, in float64 (sums in a
    fixed order: the same numbers every run)."""
    n = p.numel
    i = p.ints.sum(0).tolist()
    best = p.floats[:, 0]
    top = int(torch.argmax(best)) if n else 0  # the first program holding the max: the first index
    hist = p.hist.to(torch.int64).sum(0).cpu()
    hist[0] -= p.padded
    return ErrorStatistics(
        numel=n, n_finite=i[0], max_ulp=float(best.max()) if n else 0.0,
        argmax_ulp=int(p.ints[top, 6]) if n else 0, sum_ulp=float(p.floats[:, 1].sum()),
        histogram=hist,
        max_abs=float(p.floats[:, 2].max()), max_rel=float(p.floats[:, 3].max()),
        sum_sq_err=float(p.floats[:, 4].sum()), sum_sq_ref=float(p.floats[:, 5].sum()),
        sum_sq_out=float(p.floats[:, 6].sum()), sum_out_ref=float(p.floats[:, 7].sum()),
        overflow=i[1], underflow=i[2], nan=i[3], missing_nan=i[4], flushed_subnormal=i[5],
    )


def error_statistics(out, ref, dtype=None, *, scale: float = 1.0, log_domain: bool = False,
                     underflow_floor: float = 0.0, block: int | None = None, iters: int | None = None) -> ErrorStatistics:
    """The statistics in one pass of the Triton kernel (CUDA, or CPU under the interpreter), then
    the programs' partials combined. ``scale`` must be a power of two (fp8's per-tensor scales are)."""
    return combine(launch_statistics(out, ref, dtype, scale=scale, log_domain=log_domain,
                                     underflow_floor=underflow_floor, block=block, iters=iters))


def install():
    """Make ``numerics.metrics.compare`` take its statistics of CUDA tensors from the kernel; returns
    what was installed before (``numerics.metrics.restore_fused_statistics``)."""
    from pytest_precision.numerics.metrics import install_fused_statistics

    return install_fused_statistics(error_statistics, KERNEL_DTYPES)
