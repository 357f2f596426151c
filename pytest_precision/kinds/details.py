"""Per-case detail of tensor kinds for the reports (``--precision-report``, ``--precision-plots``):
every output's metrics and budgets, a histogram of ULPs and, for kinds with a magnitude input
(softmax's logits), the error by magnitude.

Merged into the case's record, and like it plain JSON-able data, because records cross from
xdist workers to the controller through ``workeroutput``. Floats may be inf or NaN here; the JSON
report spells those as strings.
"""
from __future__ import annotations

import math

import torch

from ..numerics.metrics import Comparison

__all__ = ["ULP_EDGES", "MAGNITUDE_EDGES", "output_detail", "ulp_histogram", "error_by_magnitude"]

# Bin i (0 < i < len) counts ULPs in (ULP_EDGES[i-1], ULP_EDGES[i]]; bin 0 counts exact zeros and the
# last bin everything above the top edge. Powers of two: errors of interest span 0.5 to 10^5 ULP.
ULP_EDGES = (0.0, 0.5, *(float(2 ** k) for k in range(0, 21)))
# |x - row max| bins, same convention: bin 0 is the row's maximum itself.
MAGNITUDE_EDGES = (0.0, *(float(2 ** k) for k in range(-3, 13)))


def ulp_histogram(cmp: Comparison) -> dict:
    """Counts of the elementwise ULP distances in ULP_EDGES bins, and of non-finite ones (a NaN or
    inf facing a finite value). Elements NaN on both sides (an expected NaN) are left out."""
    u = cmp.ulps.detach().flatten().to(torch.float64).cpu()
    finite = torch.isfinite(u)
    counts = torch.bincount(torch.bucketize(u[finite], torch.tensor(ULP_EDGES, dtype=torch.float64)),
                            minlength=len(ULP_EDGES) + 1)
    return {"counts": [int(c) for c in counts], "nonfinite": int((u == math.inf).sum())}


def error_by_magnitude(cmp: Comparison, logits: torch.Tensor) -> dict | None:
    """Per bin of |x - max of its row| (MAGNITUDE_EDGES): element count and max ULP. A
    max-subtracting softmax's error grows with the distance below the row maximum, not with |x|
    (logits around -1000 are as easy as logits around 0), so that is the magnitude binned.
    Only finite logits with a finite ULP distance count."""
    if tuple(cmp.ulps.shape) != tuple(logits.shape) or logits.dim() == 0:
        return None
    x = logits.detach().to(torch.float64).cpu()
    u = cmp.ulps.detach().to(torch.float64).cpu()
    row_max = torch.where(torch.isfinite(x), x, -math.inf).amax(-1, keepdim=True)
    keep = torch.isfinite(x) & torch.isfinite(u) & torch.isfinite(row_max)
    dist, err = (row_max - x).expand_as(x)[keep], u[keep]
    bins = torch.bucketize(dist, torch.tensor(MAGNITUDE_EDGES, dtype=torch.float64))
    n = len(MAGNITUDE_EDGES) + 1
    counts = torch.bincount(bins, minlength=n)
    worst = torch.zeros(n, dtype=torch.float64).scatter_reduce(0, bins, err, reduce="amax", include_self=True)
    return {"counts": [int(c) for c in counts], "max_ulp": [float(w) for w in worst]}


def output_detail(name: str, evidence, baseline) -> dict:
    """Output ``name`` of a tensor kind's evidence: its statistics against the oracle, the peer and
    the golden, both budgets, and its ULP histogram."""
    result = evidence.results[name]
    o, peer, pb = result.oracle, result.peer, result.peer_budget
    gc, gb = baseline.comparisons.get(name), baseline.budgets.get(name)
    return {
        "dtype": o.dtype, "shape": list(o.shape),
        "oracle": o.summary(),
        "peer": peer.summary() if peer is not None else None,
        "peer_budget": pb.as_dict() if pb is not None else None,
        "golden": gc.summary() if gc is not None else None,
        "regression_budget": gb.as_dict() if gb is not None else None,
        "ulp_histogram": ulp_histogram(o),
    }
