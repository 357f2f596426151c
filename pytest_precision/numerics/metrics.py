"""One comparison of an output with its reference: ULP, abs/rel, SQNR, cosine, and the counts
of overflow, underflow and NaN, plus the worst elements for the message."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from tabulate import tabulate

from .formats import format_of, ulp_distance

__all__ = ["Comparison", "compare", "sqnr_db", "WORST_SHOWN", "install_fused_statistics"]

WORST_SHOWN = 5


@dataclass
class Comparison:
    """Statistics of ``out`` against ``ref``, ULPs counted in ``dtype``.

    ``max_ulp`` covers every element (a NaN or inf facing a finite value makes it inf); the
    mean, p99, abs and rel cover the elements finite on both sides, and are NaN when there are
    none; SQNR and cosine are whole-tensor figures, NaN when any element is NaN or infinite where
    the reference is finite (a non-finite output is never shown as 0 off, inf dB or cosine 1).
    ``max_rel`` skips references below the dtype's smallest normal, where relative error says
    nothing.
    """

    shape: tuple[int, ...]
    dtype: str
    numel: int
    max_ulp: float
    p99_ulp: float
    mean_ulp: float
    max_abs: float
    rms_abs: float  # root mean square of the error: moves little under reordering, a lot under lost precision
    max_rel: float
    sqnr_db: float
    cosine: float
    overflow: int
    underflow: int
    nan: int
    missing_nan: int  # reference NaN (defined as NaN, e.g. a fully masked row) but out is not
    flushed_subnormal: int  # out 0 where ref rounds to a nonzero subnormal: reported, not failed
    worst: list[dict] = field(default_factory=list)
    ulps: torch.Tensor | None = field(default=None, repr=False)

    def count_over(self, ulp_budget: float) -> int:
        """Elements further than ``ulp_budget`` ULPs from the reference."""
        if self.ulps is None:
            return 0
        return int((self.ulps > ulp_budget).sum())

    def summary(self) -> dict:
        """The JSON-able statistics (what baselines record and the summary table shows)."""
        keys = ("max_ulp", "p99_ulp", "mean_ulp", "max_abs", "rms_abs", "max_rel", "sqnr_db", "cosine",
                "overflow", "underflow", "nan", "missing_nan", "flushed_subnormal")
        return {k: getattr(self, k) for k in keys}

    def statistics_lines(self, judged_on: str = "ulp") -> list[str]:
        """The statistics as message lines, the ones the verdict uses first: ULPs, or (``"abs"``,
        for outputs that cross zero, where a near-zero reference makes a ULP count huge)
        absolute error, the ULPs then only shown."""
        ulps = f"max ULP {_num(self.max_ulp)}, p99 ULP {_num(self.p99_ulp)}, mean ULP {_num(self.mean_ulp)}"
        errors = (f"max abs {_num(self.max_abs)}, RMS abs {_num(self.rms_abs)}, max rel {_num(self.max_rel)},"
                  f" SQNR {_num(self.sqnr_db)} dB, cosine {'nan' if math.isnan(self.cosine) else f'{self.cosine:.6f}'}")
        counts = (f"overflow {self.overflow}, underflow {self.underflow}, NaN {self.nan},"
                  f" NaN expected but missing {self.missing_nan}, subnormals flushed {self.flushed_subnormal}")
        if judged_on == "abs":
            return [errors, f"{ulps} (ULPs of {self.dtype}, not judged: values near zero make them large)", counts]
        return [f"{ulps} (ULPs of {self.dtype})", errors, counts]

    def worst_table(self) -> str:
        rows = [(str(w["index"]), _num(w["out"]), _num(w["ref"]), _num(w["ulp"])) for w in self.worst]
        return tabulate(rows, headers=("index", "out", "reference", "ULP"), tablefmt="plain")


def sqnr_db(signal_norm: float, error_norm: float) -> float:
    """20 log10(||ref|| / ||out - ref||) from the two norms (as torchao): inf when there is no
    error, -inf when there is error and no signal."""
    if error_norm == 0:
        return math.inf
    return 20 * math.log10(signal_norm / error_norm) if signal_norm > 0 else -math.inf


def _num(v: float) -> str:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return f"{v:.4g}"


def compare(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    scale: float = 1.0,
    log_domain: bool = False,
    underflow_floor: float = 0.0,
    keep_ulps: bool = True,
) -> Comparison:
    """Compare ``out`` with ``ref`` (float64 oracle or float32 golden), ULPs counted in ``dtype``.

    ``scale``: per-tensor scale of a scaled format (fp8): ULPs and the range limits apply to
    ``out / scale`` and ``ref / scale``. ``log_domain``: the values are logarithms of
    probabilities (log_softmax), so ``-inf`` where the reference is finite is the probability
    underflowing, counted as underflow, not overflow; and a log-probability in (-1, 1) has its
    error counted in steps of the dtype at 1.0, not at its own magnitude (see below). ``underflow_floor``: a zero counts as
    underflow only where |ref| is also above this (for sums of mixed-sign terms, attention outputs
    and gradients, a zero within rounding noise of the largest value is cancellation, not underflow).
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: output {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    dtype = dtype or out.dtype
    if _use_fused(out, dtype, scale):
        return _compare_fused(out, ref, dtype, scale, log_domain, underflow_floor, keep_ulps)
    fmt = format_of(dtype)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    os_, rs = o / scale, r / scale
    ulps = ulp_distance(os_, rs, dtype, log_domain=log_domain)

    o_nan, r_nan = torch.isnan(o), torch.isnan(r)
    r_fin = torch.isfinite(r)
    o_posinf, o_neginf = o == math.inf, o == -math.inf
    if log_domain:
        overflow = o_posinf & r_fin
        underflow = o_neginf & r_fin
    else:
        overflow = (o_posinf | o_neginf) & r_fin
        if not fmt.has_inf:  # saturating format: clipped at max while the true value lies beyond
            overflow |= (os_.abs() >= fmt.max) & (rs.abs() > fmt.max) & r_fin
        underflow = (o == 0) & (rs.abs() >= max(fmt.smallest_normal, underflow_floor / scale)) & r_fin
    flushed = (o == 0) & (rs.abs() > fmt.smallest_subnormal / 2) & (rs.abs() < fmt.smallest_normal)

    both = torch.isfinite(o) & r_fin
    fo, fr = o[both], r[both]
    fu = ulps[both]
    n_fin = fo.numel()
    lost = bool((r_fin & ~torch.isfinite(o)).any())  # NaN or inf out where the reference is finite
    if n_fin:
        diff = (fo - fr).abs()
        max_abs = float(diff.max())
        big = fr.abs() >= fmt.smallest_normal * scale
        max_rel = float((diff[big] / fr[big].abs()).max()) if bool(big.any()) else 0.0
        mean_ulp = float(fu.mean())
        p99_ulp = float(torch.quantile(fu.float(), 0.99)) if n_fin <= 16_000_000 else float(fu.max())
        err = float(torch.linalg.vector_norm(fo - fr))
        rms_abs = err / n_fin ** 0.5
        sig = float(torch.linalg.vector_norm(fr))
        sqnr = sqnr_db(sig, err)
        den = float(torch.linalg.vector_norm(fo)) * sig
        cosine = float((fo * fr).sum()) / den if den > 0 else (1.0 if err == 0 else 0.0)
    else:
        max_abs = rms_abs = max_rel = mean_ulp = p99_ulp = sqnr = cosine = math.nan
    if lost:
        sqnr = cosine = math.nan

    worst = []
    numel = ulps.numel()
    if numel:
        k = min(WORST_SHOWN, numel)
        key = torch.nan_to_num(ulps, nan=math.inf, posinf=math.inf).flatten()
        vals, idx = torch.topk(key, k)
        for v, i in zip(vals.tolist(), idx.tolist()):
            if v == 0:
                break
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tuple(out.shape)))
            worst.append({"index": index, "out": float(o.flatten()[i]), "ref": float(r.flatten()[i]), "ulp": v})

    return Comparison(
        shape=tuple(out.shape),
        dtype=fmt.name,
        numel=numel,
        max_ulp=float(ulps.max()) if numel else 0.0,
        p99_ulp=p99_ulp,
        mean_ulp=mean_ulp,
        max_abs=max_abs,
        rms_abs=rms_abs,
        max_rel=max_rel,
        sqnr_db=sqnr,
        cosine=cosine,
        overflow=int(overflow.sum()),
        underflow=int(underflow.sum()),
        nan=int((o_nan & ~r_nan).sum()),
        missing_nan=int((r_nan & ~o_nan).sum()),
        flushed_subnormal=int(flushed.sum()),
        worst=worst,
        ulps=ulps if keep_ulps else None,
    )


# A one-pass implementation of compare's statistics for CUDA tensors: (function, dtypes it takes).
# The Triton kernel in pytest_precision.kernels.error_stats installs itself here (the plugin installs
# it on CUDA runs); without one, compare uses torch ops, with the same results.
_FUSED: "tuple[Callable, frozenset] | None" = None


def install_fused_statistics(fn: Callable | None, dtypes=()) -> None:
    """Let ``compare`` take its statistics of CUDA tensors in ``dtypes`` from ``fn(out, ref, dtype,
    scale=, log_domain=, underflow_floor=)`` (an ``ErrorStatistics``); None removes it."""
    global _FUSED
    _FUSED = None if fn is None else (fn, frozenset(dtypes))


def _use_fused(out: torch.Tensor, dtype: torch.dtype, scale: float) -> bool:
    if _FUSED is None or not out.is_cuda or scale <= 0 or math.frexp(scale)[0] != 0.5:
        return False
    return dtype in _FUSED[1]


def _compare_fused(out, ref, dtype, scale, log_domain, underflow_floor, keep_ulps) -> Comparison:
    """``compare`` from the fused statistics: the same numbers as the torch path. The ULP tensor
    (worst elements, exact p99, count_over) is still made when ``keep_ulps``; without it p99 is the
    top of its power-of-two histogram bucket and the worst element is the max."""
    error_statistics = _FUSED[0]
    fmt = format_of(dtype)
    st = error_statistics(out, ref, dtype, scale=scale, log_domain=log_domain, underflow_floor=underflow_floor)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    ulps = ulp_distance(o / scale, r / scale, dtype, log_domain=log_domain) if keep_ulps else None
    max_abs, max_rel, mean_ulp = st.max_abs, st.max_rel, st.mean_ulp
    rms_abs = math.sqrt(st.sum_sq_err / st.n_finite) if st.n_finite else math.nan
    if st.n_finite:
        err, sig = math.sqrt(st.sum_sq_err), math.sqrt(st.sum_sq_ref)
        sqnr = sqnr_db(sig, err)
        den = math.sqrt(st.sum_sq_out) * sig
        cosine = st.sum_out_ref / den if den > 0 else (1.0 if err == 0 else 0.0)
        if ulps is not None:
            fu = ulps[torch.isfinite(o) & torch.isfinite(r)]
            p99 = float(torch.quantile(fu.float(), 0.99)) if fu.numel() <= 16_000_000 else float(fu.max())
        else:
            p99 = st.quantile_bound(0.99)
    else:  # nothing finite on both sides: nothing measured (as the torch path)
        sqnr = cosine = p99 = max_abs = rms_abs = max_rel = mean_ulp = math.nan
    if bool((torch.isfinite(r) & ~torch.isfinite(o)).any()):
        sqnr = cosine = math.nan
    worst = []
    if st.numel:
        if ulps is not None:
            key = torch.nan_to_num(ulps, nan=math.inf, posinf=math.inf).flatten()
            vals, idx = torch.topk(key, min(WORST_SHOWN, st.numel))
            picks = list(zip(vals.tolist(), idx.tolist()))
        else:
            picks = [(st.max_ulp, st.argmax_ulp)]
        for v, i in picks:
            if v == 0:
                break
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), tuple(out.shape)))
            worst.append({"index": index, "out": float(o.flatten()[i]), "ref": float(r.flatten()[i]), "ulp": v})
    return Comparison(
        shape=tuple(out.shape), dtype=fmt.name, numel=st.numel, max_ulp=st.max_ulp, p99_ulp=p99,
        mean_ulp=mean_ulp, max_abs=max_abs, rms_abs=rms_abs, max_rel=max_rel, sqnr_db=sqnr, cosine=cosine,
        overflow=st.overflow, underflow=st.underflow, nan=st.nan, missing_nan=st.missing_nan,
        flushed_subnormal=st.flushed_subnormal, worst=worst, ulps=ulps,
    )
