"""The command-line options and ini keys of pytest-precision, declared once: ``pytest --help``
shows them from here (``add_to``), ``RunOptions.from_config`` and the run's outputs read their
values through them, ``python -m pytest_precision`` takes the baseline directory's key and default
from here, and a test holds the README's options table against ``NAMES``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from .timelimit import DEFAULT_TIMEOUT

__all__ = ["Option", "IniKey", "GROUP", "OPTIONS", "INI_KEYS", "NAMES", "DEFAULT_BASELINE_DIR", "add_to",
           "SUITE", "BUILTINS", "COMPILE", "UPDATE_BASELINES", "ADD_MACHINE", "CONFIGS", "DEVICE", "NO_SPEED", "TRACE", "AUDIT",
           "STRICT_BUDGETS", "SPEED_THRESHOLD", "FRESH_SEED", "EXPLORE", "TRAIN_SEEDS", "REPORT", "REPORT_MD", "PLOTS", "OUTPUT_OPTIONS",
           "BASELINE_DIR", "TARGETS", "KINDS", "TIMEOUT"]

GROUP = ("precision", "numerical precision checks (pytest-precision)")  # pytest's option group: name, title


@dataclass(frozen=True)
class Option:
    """A command-line option: a flag (``store_true``) unless it takes a value (``metavar`` or ``choices``)."""

    name: str  # as typed: "--precision-suite"
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        """The attribute pytest stores it under (``config.getoption``)."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def flag(self) -> bool:
        return self.metavar is None and self.choices is None

    def value(self, config: pytest.Config):
        return config.getoption(self.dest)


@dataclass(frozen=True)
class IniKey:
    """A key of the ``[pytest]`` ini section (or ``[tool.pytest.ini_options]``)."""

    name: str
    help: str
    type: str | None = None  # pytest's ini type ("linelist"); None: a string
    default: str | tuple[str, ...] = ""  # a linelist's as a tuple: pytest gets a fresh list per run

    def value(self, config: pytest.Config):
        return config.getini(self.name)


SUITE = Option("--precision-suite",
               "run the suites on the registered targets (the built-in targets when none is registered)")
BUILTINS = Option("--precision-builtins",
                  "also run the built-in targets (torch's ops, the project's Triton kernels, tiny_gpt) beside the "
                  "registered ones, for comparison (with nothing registered they run anyway)")
COMPILE = Option("--precision-compile",
                 "also run each target under torch.compile in every config (config ids +compiled), judged like the "
                 "eager one and against it")
UPDATE_BASELINES = Option("--precision-update-baselines",
                          "write golden baselines (atomically) and print old vs new budgets")
ADD_MACHINE = Option("--precision-add-machine",
                     "add this machine's budgets to the existing goldens that pass on it (a first run on a new GPU): "
                     "only their JSON gains the machine's key; their tensors and other machines' budgets stay, and "
                     "a case without a golden writes none")
CONFIGS = Option("--precision-configs",
                 "configs to run: fp32,tf32,fp16,bf16,amp-fp16,amp-bf16,fp8-e4m3 (default: all the device runs); the "
                 "training suite runs the recipes of each (amp-fp16: with and without a GradScaler; bf16: pure bf16, "
                 "with stochastic rounding, DDP's bf16 hook, FSDP2 in bf16; fp16: DDP's fp16 hook, FSDP2 in fp16)",
                 metavar="ID,ID")
DEVICE = Option("--precision-device", "device to run on (default: cuda when available, else cpu)",
                choices=("cpu", "cuda"))
NO_SPEED = Option("--precision-no-speed",
                  "do not time suite cases: no speed or memory gate, no speed records written, no tensor-core "
                  "alignment lint")
TRACE = Option("--precision-trace",
               "trace every suite case op by op (forward and backward: dtypes, non-finite and zero counts, max |out|, "
               "source line) and print the traces")
AUDIT = Option("--precision-audit",
               "print, per target and config, the dtype each op really ran in, and flag matmuls left in fp32 under "
               "autocast, softmax/norms/losses in 16 bits and explicit 16-bit casts")
STRICT_BUDGETS = Option("--precision-strict-budgets",
                        "a machine with no regression budget of its own fails its cases instead of being judged by "
                        "the widest budget of other machines (scaled by its peer error)")
SPEED_THRESHOLD = Option("--precision-speed-threshold",
                         "fail a case this much slower than its recorded median, when clear of the noise (default: 10 "
                         "on CUDA, 20 on CPU)", metavar="PERCENT")
FRESH_SEED = Option("--precision-fresh-seed",
                    "the seed of every target's fresh inputs, to replay what a failing case printed (default: each "
                    "target's own, derived from its code: the same every run until the code changes)", metavar="N")
EXPLORE = Option("--precision-explore",
                 "draw new inputs every run: fresh inputs from a new seed (printed, with the command that replays "
                 "it) and new examples in the drawn regime's search; a seed that fails is remembered in pytest's "
                 "cache and replayed first by later runs until it passes (for local runs and scheduled jobs)")
TRAIN_SEEDS = Option("--precision-train-seeds",
                     "run each training config from N seeds too (cases train_step[TARGET-CONFIG-seedsN]) and fail a "
                     "config whose failure rate is above fp32's (Fisher's exact test, one-sided, p < 0.01); overrides "
                     "TrainSpec(seeds=); 1: no such case", metavar="N")
REPORT = Option("--precision-report",
                "write every suite case (metrics, budgets, timings, verdict) as JSON (schema: "
                "pytest_precision.reporting.report.REPORT_SCHEMA)", metavar="FILE.json")
REPORT_MD = Option("--precision-report-md",
                   "write the summary table, totals and failing cases as Markdown (CI job summaries, PR comments)",
                   metavar="FILE")
PLOTS = Option("--precision-plots",
               "write PNG figures (ULP histogram per config, error against logit magnitude) to DIR; needs the plots "
               "extra (matplotlib)", metavar="DIR")

DEFAULT_BASELINE_DIR = "precision_baselines"
BASELINE_DIR = IniKey("precision_baseline_dir", "directory of golden baselines, relative to the rootdir",
                      default=DEFAULT_BASELINE_DIR)
TARGETS = IniKey("precision_targets", "targets as 'package.module:function kind' lines", type="linelist", default=())
KINDS = IniKey("precision_kinds", "kinds as 'package.module:KIND' lines (pytest_precision.Kind objects)",
               type="linelist", default=())
TIMEOUT = IniKey("precision_timeout",
                 "seconds a suite case may run before it fails with the stack where it was (0 or inf: no limit; "
                 f"pytest-timeout's timeout marker on a case replaces it); default {DEFAULT_TIMEOUT:g}",
                 default=str(DEFAULT_TIMEOUT))

# in the order pytest --help lists them
OPTIONS = (SUITE, BUILTINS, COMPILE, UPDATE_BASELINES, ADD_MACHINE, CONFIGS, DEVICE, NO_SPEED, TRACE, AUDIT, STRICT_BUDGETS,
           SPEED_THRESHOLD, FRESH_SEED, EXPLORE, TRAIN_SEEDS, REPORT, REPORT_MD, PLOTS)
OUTPUT_OPTIONS = (REPORT, REPORT_MD, PLOTS)  # files a run leaves: asking for one makes records carry their detail
INI_KEYS = (BASELINE_DIR, TARGETS, KINDS, TIMEOUT)
NAMES = frozenset(o.name for o in (*OPTIONS, *INI_KEYS))


def add_to(parser: pytest.Parser) -> None:
    """Declare every option (in pytest-precision's group of ``pytest --help``) and ini key."""
    group = parser.getgroup(*GROUP)
    for o in OPTIONS:
        extra = {"action": "store_true"} if o.flag else {"metavar": o.metavar} if o.metavar else {"choices": o.choices}
        group.addoption(o.name, help=o.help, **extra)
    for key in INI_KEYS:
        default = list(key.default) if isinstance(key.default, tuple) else key.default
        parser.addini(key.name, key.help, **({"type": key.type} if key.type else {}), default=default)
