"""One comparison of an output with its reference: ULP, abs/rel, SQNR, cosine, and the counts
of overflow, underflow and NaN, plus the worst elements for the message; and the
:class:`ComparisonSpec` that says how an output is compared (the peer's check and the golden's
read the same one)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from tabulate import tabulate

from .formats import format_of, ulp_distance

__all__ = ["Comparison", "ComparisonSpec", "Elementwise", "compare", "sqnr_db", "WORST_SHOWN", "install_fused_statistics",
           "restore_fused_statistics"]

WORST_SHOWN = 5


@dataclass(frozen=True)
class Elementwise:
    """What only the elementwise ULP tensor gives: the tensor itself, the exact p99 and the worst
    elements. Failure messages and reports need it; a passing case without a report does not."""

    ulps: torch.Tensor
    p99_ulp: float
    worst: list[dict]


@dataclass
class Comparison:
    """Statistics of ``out`` against ``ref``, ULPs counted in ``dtype``.

    ``max_ulp`` covers every element (a NaN or inf facing a finite value makes it inf); the
    mean, p99, abs and rel cover the elements finite on both sides, and are NaN when there are
    none; SQNR and cosine are whole-tensor figures, NaN when any element is NaN or infinite where
    the reference is finite (a non-finite output is never shown as 0 off, inf dB or cosine 1).
    ``max_rel`` skips references below the dtype's smallest normal, where relative error says
    nothing.
    ``ulps``, ``p99_ulp`` and ``worst`` come from the elementwise ULP tensor, made on first use
    (on CUDA the one-pass kernel gives everything else without it).
    """

    shape: tuple[int, ...]
    dtype: str
    numel: int
    max_ulp: float
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
    # zeros where |ref| is below this are cancellation, judged as error, not counted as underflow
    underflow_floor: float = 0.0
    elementwise_fn: Callable[[], Elementwise] = field(repr=False, compare=False, default=None)

    @functools.cached_property
    def elementwise(self) -> Elementwise:
        return self.elementwise_fn()

    @property
    def ulps(self) -> torch.Tensor:
        return self.elementwise.ulps

    @property
    def p99_ulp(self) -> float:
        return self.elementwise.p99_ulp

    @property
    def worst(self) -> list[dict]:
        return self.elementwise.worst

    def count_over(self, ulp_budget: float) -> int:
        """Elements further than ``ulp_budget`` ULPs from the reference."""
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
        underflow = str(self.underflow)
        if self.underflow and self.underflow_floor > 0:  # what a zero had to lose to count
            underflow += (f" (0 where the exact value is at least {_num(self.underflow_floor)}, more than cancellation"
                          " of larger terms explains)")
        counts = (f"overflow {self.overflow}, underflow {underflow}, NaN {self.nan},"
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
) -> Comparison:
    """Compare ``out`` with ``ref`` (float64 oracle or float32 golden), ULPs counted in ``dtype``.

    ``scale``: per-tensor scale of a scaled format (fp8): ULPs and the range limits apply to
    ``out / scale`` and ``ref / scale``. ``log_domain``: the values are logarithms of
    probabilities (log_softmax), so ``-inf`` where the reference is finite is the probability
    underflowing, counted as underflow, not overflow; and a log-probability in (-1, 1) has its
    error counted in steps of the dtype at 1.0, not at its own magnitude.

    Underflow: ``out`` is 0 where ``ref`` is representable (at least the dtype's smallest normal;
    a smaller one is a flushed subnormal, reported, not failed) and at least ``underflow_floor``.
    The floor is the kind's estimate of what cancellation of larger terms explains: a sum of
    mixed-sign terms (attention outputs, gradients) or ``1 + tanh(u)`` with ``tanh(u)`` near -1
    (GELU far below 0) gives 0 within rounding noise of its terms without losing a value; such a
    zero is error, judged by the kind's budget. 0 (the default) for outputs that keep their
    relative precision (exp, softmax, ULP-judged ops), where any representable value lost to 0
    is underflow.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: output {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    dtype = dtype or out.dtype
    if _use_fused(out, dtype, scale):
        return _compare_fused(out, ref, dtype, scale, log_domain, underflow_floor)
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

    o_fin = torch.isfinite(o)
    both = o_fin & r_fin
    lost = bool((r_fin & ~o_fin).any())  # NaN or inf out where the reference is finite
    fo, fr = o[both], r[both]
    fu = ulps[both]
    n_fin = fo.numel()
    if n_fin:
        diff = (fo - fr).abs()
        max_abs = float(diff.max())
        big = fr.abs() >= fmt.smallest_normal * scale
        max_rel = float((diff[big] / fr[big].abs()).max()) if bool(big.any()) else 0.0
        mean_ulp = float(fu.mean())
        err = float(torch.linalg.vector_norm(fo - fr))
        rms_abs = err / n_fin ** 0.5
        sig = float(torch.linalg.vector_norm(fr))
        sqnr = sqnr_db(sig, err)
        den = float(torch.linalg.vector_norm(fo)) * sig
        cosine = float((fo * fr).sum()) / den if den > 0 else (1.0 if err == 0 else 0.0)
    else:
        max_abs = rms_abs = max_rel = mean_ulp = sqnr = cosine = math.nan
    if lost:
        sqnr = cosine = math.nan
    numel = ulps.numel()
    return Comparison(
        shape=tuple(out.shape),
        dtype=fmt.name,
        numel=numel,
        max_ulp=float(ulps.max()) if numel else 0.0,
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
        underflow_floor=_floor_shown(fmt, scale, log_domain, underflow_floor),
        elementwise_fn=functools.partial(_elementwise, ulps, o, r, tuple(out.shape)),
    )


def _floor_shown(fmt, scale: float, log_domain: bool, underflow_floor: float) -> float:
    """The cancellation floor where it decided something (above the dtype's smallest normal, not
    in the log domain, where underflow is -inf), else 0."""
    return underflow_floor if not log_domain and underflow_floor / scale > fmt.smallest_normal else 0.0


def _elementwise(ulps: torch.Tensor, o: torch.Tensor, r: torch.Tensor, shape: tuple) -> Elementwise:
    """The exact p99 of the finite distances and the WORST_SHOWN largest distances, from the ULP
    tensor of float64 ``o`` against ``r``."""
    fu = ulps[torch.isfinite(o) & torch.isfinite(r)]
    if fu.numel():
        p99 = float(torch.quantile(fu.float(), 0.99)) if fu.numel() <= 16_000_000 else float(fu.max())
    else:
        p99 = math.nan  # nothing finite on both sides: nothing measured
    worst = []
    if ulps.numel():
        key = torch.nan_to_num(ulps, nan=math.inf, posinf=math.inf).flatten()
        vals, idx = torch.topk(key, min(WORST_SHOWN, ulps.numel()))
        for v, i in zip(vals.tolist(), idx.tolist()):
            if v == 0:
                break
            index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), shape))
            worst.append({"index": index, "out": float(o.flatten()[i]), "ref": float(r.flatten()[i]), "ulp": v})
    return Elementwise(ulps, p99, worst)


@dataclass
class ComparisonSpec:
    """How an output is compared with its exact result: ``compare``'s dtype, scale, log domain and
    underflow floor; and, for an output judged on absolute error (one that crosses zero), the
    max-abs and RMS error a correct implementation can reach under another summation order
    (``abs_floor``, ``rms_floor``): budgets never sit below them. ``abs_floor`` None: judged on ULPs."""

    dtype: torch.dtype
    scale: float = 1.0
    log_domain: bool = False
    underflow_floor: float = 0.0
    abs_floor: float | None = None
    rms_floor: float | None = None

    @property
    def on_abs(self) -> bool:
        """Whether budgets are on absolute error (max and RMS) rather than ULPs."""
        return self.abs_floor is not None

    def compare(self, out: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> Comparison:
        """``out`` against ``ref`` as this spec says (``scale``: another tensor's own, as a peer's fp8 output)."""
        return compare(out, ref, self.dtype, scale=self.scale if scale is None else scale, log_domain=self.log_domain,
                       underflow_floor=self.underflow_floor)

    def comparison_spec(self) -> "ComparisonSpec":
        """This spec alone (from a subclass that carries more, such as a kind's ``OutputRule``)."""
        return ComparisonSpec(self.dtype, self.scale, self.log_domain, self.underflow_floor, self.abs_floor,
                              self.rms_floor)


# A one-pass implementation of compare's statistics for CUDA tensors: (function, dtypes it takes).
# The Triton kernel in pytest_precision.kernels.error_stats installs itself here (the plugin installs
# it on CUDA runs); without one, compare uses torch ops, with the same results.
_FUSED: "tuple[Callable, frozenset] | None" = None


def install_fused_statistics(fn: Callable | None, dtypes=()) -> "tuple[Callable, frozenset] | None":
    """Let ``compare`` take its statistics of CUDA tensors in ``dtypes`` from ``fn(out, ref, dtype,
    scale=, log_domain=, underflow_floor=)`` (an ``ErrorStatistics``); None removes it. Returns what
    was installed before, for ``restore_fused_statistics``."""
    global _FUSED
    previous, _FUSED = _FUSED, (None if fn is None else (fn, frozenset(dtypes)))
    return previous


def restore_fused_statistics(previous: "tuple[Callable, frozenset] | None") -> None:
    """Put back what ``install_fused_statistics`` returned (a session ending inside another)."""
    global _FUSED
    _FUSED = previous


def _use_fused(out: torch.Tensor, dtype: torch.dtype, scale: float) -> bool:
    if _FUSED is None or not out.is_cuda or scale <= 0 or math.frexp(scale)[0] != 0.5:
        return False
    return dtype in _FUSED[1]


def _compare_fused(out, ref, dtype, scale, log_domain, underflow_floor) -> Comparison:
    """``compare`` from the fused statistics: the same numbers as the torch path. The ULP tensor
    (worst elements, exact p99, count_over) is made only when something asks for it."""
    error_statistics = _FUSED[0]
    fmt = format_of(dtype)
    st = error_statistics(out, ref, dtype, scale=scale, log_domain=log_domain, underflow_floor=underflow_floor)
    max_abs, max_rel, mean_ulp = st.max_abs, st.max_rel, st.mean_ulp
    if st.n_finite:
        err, sig = math.sqrt(st.sum_sq_err), math.sqrt(st.sum_sq_ref)
        rms_abs = err / math.sqrt(st.n_finite)
        sqnr = sqnr_db(sig, err)
        den = math.sqrt(st.sum_sq_out) * sig
        cosine = st.sum_out_ref / den if den > 0 else (1.0 if err == 0 else 0.0)
    else:  # nothing finite on both sides: nothing measured (as the torch path)
        sqnr = cosine = max_abs = rms_abs = max_rel = mean_ulp = math.nan
    # NaN or inf out where the reference is finite: the kernel counted it as NaN, overflow or
    # underflow (log domain), so a clean output skips the second pass over both tensors
    if (st.nan or st.overflow or st.underflow) and bool((torch.isfinite(ref) & ~torch.isfinite(out)).any()):
        sqnr = cosine = math.nan

    def elementwise() -> Elementwise:
        o = out.detach().to(torch.float64)
        r = ref.detach().to(device=o.device, dtype=torch.float64)
        return _elementwise(ulp_distance(o / scale, r / scale, dtype, log_domain=log_domain), o, r, tuple(out.shape))

    return Comparison(
        shape=tuple(out.shape), dtype=fmt.name, numel=st.numel, max_ulp=st.max_ulp, mean_ulp=mean_ulp,
        max_abs=max_abs, rms_abs=rms_abs, max_rel=max_rel, sqnr_db=sqnr, cosine=cosine, overflow=st.overflow,
        underflow=st.underflow, nan=st.nan, missing_nan=st.missing_nan, flushed_subnormal=st.flushed_subnormal,
        underflow_floor=_floor_shown(fmt, scale, log_domain, underflow_floor), elementwise_fn=elementwise,
    )
