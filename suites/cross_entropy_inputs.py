"""The cross_entropy kind's inputs: logits and class targets (``CrossEntropyInputs``), its seeded
regimes (small: their goldens are committed) and its fresh regime, one of their families on rows and
classes drawn anew."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_precision.kinds import Plan, Regime, Target, seeded_normal

__all__ = ["BASE_SEED", "IGNORE_INDEX", "CrossEntropyInputs", "REGIMES", "FRESH_FAMILIES", "fresh_cross_entropy_regime",
           "draw_inputs"]

BASE_SEED = 20261125
IGNORE_INDEX = -100  # torch's default
ROWS, CLASSES = 16, 256  # small: goldens are committed


@dataclass
class CrossEntropyInputs:
    logits: torch.Tensor
    target: torch.Tensor
    ignore_index: int = IGNORE_INDEX
    label_smoothing: float = 0.0
    # the loss of a batch whose rows are all ignored, by the target's convention (``all_ignored``
    # declared): "nan" (torch's 0 / 0) or "zero" (libraries that return 0 there)
    all_ignored: str = "nan"

    @property
    def none_counted(self) -> bool:
        return bool((self.target == self.ignore_index).all())

    @property
    def ignores(self) -> bool:
        return bool((self.target == self.ignore_index).any())

    def __repr__(self) -> str:  # what Hypothesis prints for a falsifying example
        return (f"CrossEntropyInputs(logits={tuple(self.logits.shape)}, dtype={self.logits.dtype}, "
                f"target={self.target.tolist()}, label_smoothing={self.label_smoothing}, "
                f"largest |logit| {float(self.logits.abs().max()) if self.logits.numel() else 0:.4g})")


def draw_inputs(g: torch.Generator, rows: int, classes: int, scale: float = 1.0, margin: float | None = None,
            ignored: float = 0.0, label_smoothing: float = 0.0) -> CrossEntropyInputs:
    """Logits N(0, scale^2) and uniform targets; ``margin``: the target's logit set that far above
    the row's largest (a confident row); ``ignored``: the share of rows whose target is ignore_index."""
    logits = seeded_normal(g, rows, classes, scale=scale)
    target = torch.randint(0, classes, (rows,), generator=g)
    if margin is not None:
        logits[torch.arange(rows), target] = logits.amax(-1) + margin
    if ignored:
        drop = torch.rand(rows, generator=g) < ignored
        target = torch.where(drop, torch.full_like(target, IGNORE_INDEX), target)
    return CrossEntropyInputs(logits, target, IGNORE_INDEX, label_smoothing)


def _regime(name: str, description: str, **shape) -> Regime:
    shape.setdefault("rows", ROWS)
    shape.setdefault("classes", CLASSES)
    return Regime.from_generator(name, description, lambda g: draw_inputs(g, **shape), BASE_SEED, shape)


REGIMES: dict[str, Regime] = {r.name: r for r in (
    _regime("unit", "N(0, 1) logits, 16 x 256"),
    # differences of up to about 250: exp overflows fp16 past 11.09 without the max subtracted
    _regime("scale40", "N(0, 40^2) logits: past fp16's exp range", scale=40.0),
    _regime("vocab32768", "2 rows over 32768 classes", rows=2, classes=32768, scale=5.0),
    # a number of classes that is no power of two, as the fresh regime draws: met by a seeded regime first
    _regime("vocab1000", "16 rows over 1000 classes (no power of two)", classes=1000, scale=5.0),
    # p(target) near 0.99, the loss near 0.01, held to fp32's steps at 1.0 (a margin of 20 made the loss
    # 5e-7, below that budget: an all-zeros loss and gradient passed it, kinds.tensor.contract.degenerate)
    _regime("confident", "the target's logit 10 above the rest: p near 1, loss near 0", margin=10.0),
    _regime("ignored", "a quarter of the rows ignored (target -100)", ignored=0.25),
    _regime("all-ignored", "every row ignored: expected loss NaN (0 / 0; 0 where all_ignored='zero' is declared), "
            "gradient 0", rows=4, ignored=1.0),
    _regime("smoothing", "label_smoothing 0.1, N(0, 5^2) logits", scale=5.0, label_smoothing=0.1),
)}


# The fresh regime (kinds.fresh): one of the fixed regimes' families, on rows and classes drawn anew
# every run, never the fixed ones (16 or 4 rows; 256 or 32768 classes); the keyword families
# only for a target that takes the keyword
FRESH_FAMILIES: dict[str, dict] = {
    "unit": {},
    "scale5": dict(scale=5.0),
    "scale40": dict(scale=40.0),
    "confident": dict(margin=10.0),
    "ignored": dict(ignored=0.25),
    "smoothing": dict(scale=5.0, label_smoothing=0.1),
}
_FAMILY_KEYWORD = {"ignored": "ignore_index", "smoothing": "label_smoothing"}


def fresh_cross_entropy_regime(target: Target, seed: int) -> Regime:
    plan = Plan(seed)
    # 3 rows at least: one row over 209 classes at scale 40 whose target was the largest logit by far had a
    # loss and gradient that zeros passed in bf16 (kinds.tensor.contract.degenerate)
    rows, classes = plan.integer(3, 24, avoid=(ROWS, 4)), plan.length(2, 4096, avoid=(CLASSES, 32768, 1000))
    family = plan.choice(tuple(f for f in FRESH_FAMILIES if f not in _FAMILY_KEYWORD
                               or target.accepts(_FAMILY_KEYWORD[f])))
    shape = dict(rows=rows, classes=classes, **FRESH_FAMILIES[family])
    return plan.regime(f"{rows} rows over {classes} classes, as the {family} regime's", lambda g: draw_inputs(g, **shape),
                       family=family, **shape)
