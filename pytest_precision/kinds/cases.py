"""The case matrix's parts: the seeded input :class:`Regime` s and the :class:`DrawnRegime`, the
:class:`Variant` s of a config (an SDPA backend, a compiled target), and the :class:`Case`, one
cell of the matrix (kind, target, config, variant, regime, device, and the session's run state)."""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from .session import RunState
from .target import Target, TargetError

if TYPE_CHECKING:  # (Kind and TensorKind are named in annotations only, as strings: their modules import
    # this one, and tests/test_layers.py counts an import under TYPE_CHECKING as a cycle too)
    from .tensor.measurement import MeasureContext, Measurement

__all__ = ["Regime", "DrawnRegime", "Variant", "NO_VARIANT", "Case"]


@dataclass(frozen=True)
class _FromGenerator:
    """``make(g)`` as a function of the seed: ``g`` a CPU generator seeded with it (``Regime.from_generator``)."""

    make: Callable[[torch.Generator], Any]

    def __call__(self, seed: int) -> Any:
        return self.make(torch.Generator(device="cpu").manual_seed(seed))


@dataclass(frozen=True)
class Regime:
    """A named input regime: ``make(seed)`` builds the inputs (float32, CPU) from the regime's seed,
    which is the kind's base seed plus a hash of the name, so adding a regime moves no other;
    ``Regime.from_generator`` makes one whose ``make(g)`` gets a CPU ``torch.Generator`` seeded with
    it (what every built-in kind uses). ``irregular``: sizes deliberately off the tensor cores'
    multiples (the alignment lint, which speaks about the user's own shapes, stays quiet on it)."""

    name: str
    description: str
    make: Callable[[int], Any]
    base_seed: int
    parameters: dict = field(default_factory=dict)  # what the golden's input spec records besides the seed
    irregular: bool = False

    @property
    def seed(self) -> int:
        return self.base_seed + zlib.crc32(self.name.encode()) % 100_000

    @classmethod
    def from_generator(cls, name: str, description: str, make: Callable[[torch.Generator], Any], base_seed: int,
                       parameters: dict | None = None, irregular: bool = False) -> "Regime":
        """A regime whose ``make(g)`` draws its inputs from ``g``, a CPU ``torch.Generator`` the
        regime seeds with its seed (draw from ``g`` alone, and the inputs have the same bits on
        every run; ``numerics.inputs.seeded_normal`` draws normals with the same bits on every CPU)."""
        return cls(name, description, _FromGenerator(make), base_seed, dict(parameters or {}), irregular)

    def inputs(self) -> Any:
        return self.make(self.seed)


@dataclass(frozen=True)
class DrawnRegime:
    """Inputs Hypothesis draws (``TensorKind.draw``): no golden (one file cannot hold many examples);
    the oracle with the peer budget and the counts judge each example, a failure shows the shrunk input."""

    name: str = "hypothesis"
    examples: int = 30
    # CPU seconds (of this process) for the search and the shrink together: a slow target (a Triton kernel under the
    # interpreter takes 0.1 to 1 s a call) would otherwise shrink for minutes; past it the failure
    # found so far is reported as it stands (less shrunk), and a search without one ends
    seconds: float = 20.0


class Variant:
    """A variant of every config (an SDPA backend, a compiled target): a suffix of the config id, a
    context entered around the target's call, what it makes of the target's callable (``wrap``),
    what it measures beside the target in the same case (``beside``), and the targets it does not
    apply to."""

    suffix = ""
    # whether what ``wrap`` makes is specialised on torch's process-wide flags (a compiled frame's
    # guards): the contract's re-calls then run under the flags the case ran under (kinds.tensor.contract_checks)
    guards_global_state = False

    def context(self) -> ContextManager:
        return contextlib.nullcontext()

    def wrap(self, fn: Callable) -> Callable:
        """The callable the case runs in place of the target's ``fn`` (the peer and oracle run unwrapped)."""
        return fn

    def beside(self, kind: "TensorKind", ctx: "MeasureContext", m: "Measurement") -> None:
        """Measure more in the case after the target, peer and oracle ran (each output result's ``eager`` and ``eager_budget``)."""

    def skip_reason(self, target: Target) -> str | None:
        return None

    def unavailable(self, error: TargetError, case: "Case") -> str | None:
        """A skip reason when ``error`` means the variant cannot run this case here, else None."""
        return None

    def __repr__(self) -> str:
        return f"Variant({self.suffix!r})"


NO_VARIANT = Variant()


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a kind's target under a config and variant, on one regime; ``state``
    is the session's (``RunState``: what earlier cases learned), a fresh one where none is given."""

    kind: "Kind"
    target: Target
    config: Any  # numerics.configs.Config; the training kind's TrainConfig
    variant: Variant
    regime: str
    device: str
    state: RunState = field(default_factory=RunState, compare=False, repr=False)

    @property
    def config_id(self) -> str:
        return self.config.id + self.variant.suffix

    @property
    def name(self) -> str:
        """The node name: ``softmax[torch.softmax-fp32-unit]``."""
        return f"{self.kind.name}[{self.target.name}-{self.config_id}-{self.regime}]"

    @property
    def baseline_key(self) -> str:
        return f"{self.kind.name}/{self.target.name}/{self.regime}"

    @property
    def where(self) -> str:
        return f"target {self.target.name!r} ({self.kind.name}) under config {self.config_id} on regime {self.regime}"
