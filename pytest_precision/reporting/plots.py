"""PNG figures of a run (``--precision-plots=DIR``; needs the ``plots`` extra, matplotlib):

- ``ulp-histogram-<config>.png``: per config, the ULP distances of every element of every case's
  forward output, one bar series per target, in the power-of-two bins of kinds.details.ULP_EDGES;
- ``error-vs-logit-magnitude.png``: softmax kinds, max ULP against |logit - row max|, one line per
  config and target.

matplotlib is imported only here and only when the option is used (the Agg backend: no display).

The distance below the row max, not |logit|, is what a max-subtracting softmax's error grows with:
logits around -1000 are as easy as logits around 0. Elements whose ULP distance is not finite (inf or
NaN out) are left out of that figure and counted in the histogram's inf/NaN bar.
"""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

from ..kinds.details import MAGNITUDE_EDGES, ULP_EDGES

__all__ = ["MISSING_MESSAGE", "plots_available", "write_plots"]

MISSING_MESSAGE = ("--precision-plots needs matplotlib, which is not installed: "
                   "pip install 'pytest-precision[plots]'")


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError(MISSING_MESSAGE) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bin_labels(edges) -> list[str]:
    def fmt(v):
        if 0 < v < 1:
            return f"1/{round(1 / v):d}"
        return f"{v:g}" if v < 1024 else f"2^{round(math.log2(v))}"
    return ["0", *(f"≤{fmt(e)}" for e in edges[1:]), f">{fmt(edges[-1])}"]


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "_", name)


def _ulp_histograms(records: list[dict]) -> dict[str, dict[str, list[int]]]:
    """config -> target -> summed counts (+ the non-finite count as a last bin)."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in records:
        outputs = r.get("outputs") or {}
        if not outputs:
            continue
        h = next(iter(outputs.values())).get("ulp_histogram")
        if not h:
            continue
        counts = [*h["counts"], h["nonfinite"]]
        acc = out.setdefault(r["config"], {}).setdefault(r["target"], [0] * len(counts))
        for i, c in enumerate(counts):
            acc[i] += c
    return out


def _magnitude_profiles(records: list[dict]) -> dict[tuple[str, str], list[float | None]]:
    """(target, config) -> max ULP per magnitude bin over the cases (None where a bin is empty)."""
    out: dict[tuple[str, str], list[float | None]] = {}
    for r in records:
        prof = r.get("error_by_magnitude")
        if not prof:
            continue
        acc = out.setdefault((r["target"], r["config"]), [None] * len(prof["counts"]))
        for i, (n, m) in enumerate(zip(prof["counts"], prof["max_ulp"])):
            if n:
                acc[i] = m if acc[i] is None else max(acc[i], m)
    return out


def write_plots(records: list[dict], directory: Path, config_order: list[str] | None = None) -> list[Path]:
    """Write the figures under ``directory``; returns their paths in a stable order."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    order = {c: i for i, c in enumerate(config_order or [])}
    written = []

    labels = [*_bin_labels(ULP_EDGES), "inf/NaN"]
    hists = _ulp_histograms(records)
    for config in sorted(hists, key=lambda c: (order.get(c.split("+")[0], len(order)), c)):
        by_target = hists[config]
        fig, ax = plt.subplots(figsize=(11, 4.5))
        width = 0.8 / len(by_target)
        for j, target in enumerate(sorted(by_target)):
            xs = [i + (j - (len(by_target) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, by_target[target], width=width, label=target)
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xlabel("ULP distance from the float64 oracle (bin upper edge)")
        ax.set_ylabel("elements")
        ax.set_title(f"ULP histogram, {config}: forward output of every case")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = directory / f"ulp-histogram-{_file_part(config)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    profiles = _magnitude_profiles(records)
    if profiles:
        # a bin is plotted at its upper edge; bin 0 (the row maximum itself) at half the first edge
        centres = [MAGNITUDE_EDGES[1] / 2, *MAGNITUDE_EDGES[1:], MAGNITUDE_EDGES[-1] * 2]
        fig, ax = plt.subplots(figsize=(9, 5))
        targets = sorted({t for t, _ in profiles})
        styles = ("-", "--", ":", "-.")  # a line style per target: the colour cycle repeats after ten lines
        for (target, config) in sorted(profiles, key=lambda tc: (tc[0], order.get(tc[1], len(order)), tc[1])):
            pts = [(x, y) for x, y in zip(centres, profiles[(target, config)]) if y is not None and math.isfinite(y)]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{target} {config}",
                        linestyle=styles[targets.index(target) % len(styles)])
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=0.5)  # linear below half an ULP: exact results (0) stay on the plot
        ax.set_ylim(bottom=0)
        ax.set_xlabel("|logit - row max|")
        ax.set_ylabel("max ULP from the float64 oracle")
        ax.set_title("error against logit magnitude (softmax kinds, fixed-input regimes)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        path = directory / "error-vs-logit-magnitude.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
