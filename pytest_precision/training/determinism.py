"""A spec that repeats itself: ``model_fn`` (seeded as a run seeds it) and every ``batch_fn(i)``
called twice and compared bit for bit before anything runs. A run is compared with another run of
the same spec, so a spec that does not repeat itself would be reported as precision failures (and,
under the update flag, accepted as wide budgets)."""
from __future__ import annotations

import torch
from torch import nn

from .batches import data_digest
from .run import TrainingError, judged_state
from .spec import TrainSpec

__all__ = ["check_determinism"]


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    if list(a) != list(b):
        return f"parameter names differ ({sorted(set(a) ^ set(b))[:3]})"
    for n in a:
        if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n]):
            return f"parameter {n} differs"
    return None


def check_determinism(spec: TrainSpec, where: str) -> None:
    """Call ``model_fn`` (seeded as a run seeds it) and each ``batch_fn(i)`` twice; raise
    TrainingError naming the callable whose two results differ."""
    def call(what, fn, *a):
        try:
            with judged_state(what, where):
                return fn(*a)
        except TrainingError:
            raise
        except Exception as e:
            raise TrainingError(f"{where}: {what} raised {type(e).__name__}: {e}") from e

    models = []
    for _ in range(2):
        torch.manual_seed(spec.seed)
        model = call("model_fn()", spec.model_fn)
        if not isinstance(model, nn.Module):
            raise TrainingError(f"{where}: model_fn() returned {type(model).__name__}, expected an nn.Module")
        models.append({n: p.detach().cpu().clone() for n, p in model.state_dict().items()})
    diff = _first_difference(*models)
    if diff:
        raise TrainingError(f"{where}: model_fn() built different models on two calls after the same torch.manual_seed "
                            f"({diff}): seed every generator it draws from, so each config starts from the same weights")
    for i in range(spec.steps):
        first, second = (data_digest(call(f"batch_fn({i})", spec.batch_fn, i)) for _ in range(2))
        if first != second:
            raise TrainingError(f"{where}: batch_fn({i}) returned different data on two calls: each config must see the "
                                f"same batches (seed a CPU generator with i, as pytest_precision.training.MarkovText "
                                f"does); nothing was run or written")
