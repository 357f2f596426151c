"""What a kind built on the training engine imports: the train_step kind (``suites/training.py``
and the modules it names) is written from this namespace and ``pytest_precision.training`` alone,
as a user's kind driving the engine would be (``tests/test_public_surface.py``). A thin re-export:
the engine's modules behind it are internal.

- a run and its judging: :func:`judged_state`, :class:`GlobalStateError`, :class:`ModelDtypeWarning`,
  :func:`built_dtype_note`, :func:`float64_step`, :func:`judge_run`, :func:`scale_health` and
  :class:`ScaleHealth`, :class:`LowPrecisionLoss`, :class:`Fp8Counts`;
- the careful loop beside a ``step_fn``: :class:`LoopPeer`, :func:`run_peer`, :func:`fp32_first_step`,
  :func:`fp32_whole_run`; one step of a spec, :func:`single_step`;
- accumulation and checkpointing: :func:`exact_batch_gradients`, :func:`judge_accumulation`,
  :func:`judge_checkpoint`;
- distributed: :func:`ddp_skip_reason`, :func:`compare_ddp_hooks`, :class:`HookComparison`,
  :class:`RankRunError`, :func:`fsdp_skip_reason`, :func:`compare_fsdp`, :class:`FSDPComparison`,
  :class:`BatchShardError`;
- success over seeds: :func:`seeded_spec`, :func:`seed_runs`, :class:`SeedRun`, :class:`SeedRates`,
  :func:`rates_of`, :func:`least_failing_count`, ``ALPHA``;
- goldens: :class:`TrajectoryEntry`, :class:`DDPEntry`, :class:`TrajectoryBudget`, ``OUTPUT``;
- limits: :func:`sqnr_floor_db`, :func:`first_step_floor_db`, :func:`later_step_floor_db`,
  ``DDP_MARGIN_DB``, ``UNDERFLOW_LIMIT``, :func:`limit_problem`, :func:`unresolved_reason`;
- the report's wording: :func:`rates_line`, :func:`speedup_text`, :func:`history_text`,
  :func:`worst_text`, :func:`percent`.
"""
from ..training.accumulation import exact_batch_gradients, judge_accumulation
from ..training.baseline import OUTPUT, DDPEntry, TrajectoryEntry, rates_line
from ..training.budget import TrajectoryBudget
from ..training.checkpointing import judge_checkpoint
from ..training.compare import speedup_text, unresolved_reason
from ..training.distributed import HookComparison, RankRunError, compare_ddp_hooks, ddp_skip_reason
from ..training.float64 import float64_step
from ..training.fp8 import Fp8Counts, worst_text
from ..training.fsdp import BatchShardError, FSDPComparison, compare_fsdp, fsdp_skip_reason
from ..training.limits import (DDP_MARGIN_DB, UNDERFLOW_LIMIT, first_step_floor_db, later_step_floor_db, limit_problem,
                               percent, sqnr_floor_db)
from ..training.loss_precision import LowPrecisionLoss
from ..training.loss_scale import ScaleHealth, history_text, scale_health
from ..training.peer import LoopPeer, fp32_first_step, fp32_whole_run, run_peer
from ..training.run import GlobalStateError, ModelDtypeWarning, built_dtype_note, judged_state
from ..training.spec import single_step
from ..training.success_rate import ALPHA, SeedRates, SeedRun, least_failing_count, rates_of, seed_runs, seeded_spec
from ..training.verdicts import judge_run

__all__ = ["judged_state", "GlobalStateError", "ModelDtypeWarning", "built_dtype_note", "float64_step", "judge_run",
           "scale_health", "ScaleHealth", "LowPrecisionLoss", "Fp8Counts", "LoopPeer", "run_peer", "fp32_first_step",
           "fp32_whole_run", "single_step", "exact_batch_gradients", "judge_accumulation", "judge_checkpoint",
           "ddp_skip_reason", "compare_ddp_hooks", "HookComparison", "RankRunError", "fsdp_skip_reason", "compare_fsdp",
           "FSDPComparison", "BatchShardError", "seeded_spec", "seed_runs", "SeedRun", "SeedRates", "rates_of",
           "least_failing_count", "ALPHA", "TrajectoryEntry", "DDPEntry", "TrajectoryBudget", "OUTPUT",
           "sqnr_floor_db", "first_step_floor_db", "later_step_floor_db", "DDP_MARGIN_DB", "UNDERFLOW_LIMIT",
           "limit_problem", "unresolved_reason", "rates_line", "speedup_text", "history_text", "worst_text", "percent"]
