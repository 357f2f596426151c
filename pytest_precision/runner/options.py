"""The options of one pytest run, resolved once (device, configs, baseline store, flags), and the
records its suite cases leave for the summary and the reports."""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ..baselines.commands import update_command
from ..baselines.store import BaselineStore
from ..kinds.fresh import new_seed, parse_seed
from ..kinds.registry import Target, parse_ini_kinds, parse_ini_targets
from ..numerics.configs import CONFIG_IDS, Config, select_configs
from ..platform.devices import fingerprint
from ..speed.gate import DEFAULT_THRESHOLD
from .exits import IMPORT_ADVICE, TargetEnded, refuse_process_exits
from .option_table import (AUDIT, BASELINE_DIR, BUILTINS, COMPILE, CONFIGS, DEVICE, EXPLORE, FRESH_SEED, KINDS, NO_SPEED,
                           OUTPUT_OPTIONS, SPEED_THRESHOLD, STRICT_BUDGETS, SUITE, TARGETS, TIMEOUT, TRACE, TRAIN_SEEDS,
                           UPDATE_BASELINES, ADD_MACHINE, IniKey)
from .timelimit import DEFAULT_TIMEOUT, NO_LIMIT_ABOVE

__all__ = ["RunOptions", "OPTIONS_KEY", "RECORDS_KEY", "FRESH_SEED_KEY", "load_ini_kinds", "parse_timeout"]

FRESH_SEED_KEY = "precision_fresh_seed"  # xdist workerinput key: the controller's fresh seed, every worker's


@dataclass
class RunOptions:
    device: str
    configs: list[Config]
    store: BaselineStore
    update: bool
    run_suite: bool
    default_device: str
    ini_targets: list[Target] = field(default_factory=list)
    builtins: bool = False  # the built-in targets beside registered ones (--precision-builtins)
    speed: bool = True  # time every suite case and gate it (off with --precision-no-speed)
    speed_threshold: float = 0.2  # a fraction: 0.1 is 10 % slower
    trace: bool = False  # trace every suite case op by op (--precision-trace)
    strict_budgets: bool = False  # no budget borrowed from other machines (--precision-strict-budgets)
    parallel: str | None = None  # why this process's timings share the CPU by design (xdist workers)
    audit: bool = False  # audit the dtypes each op ran in, per target and config (--precision-audit)
    compile: bool = False  # each target also under torch.compile (--precision-compile)
    timeout: float = DEFAULT_TIMEOUT  # seconds a suite case may run (ini precision_timeout; 0: no limit)
    # a report or plots asked for: each case's record carries its detail (histograms, budgets,
    # headline), which needs the elementwise ULP tensors that a passing case otherwise never makes
    details: bool = False
    # the fresh regime's seed for every target (kinds.fresh): --precision-fresh-seed, else under
    # --precision-explore the xdist controller's or a new one; None: each target's own, derived from its code
    fresh_seed: int | None = None
    explore: bool = False  # --precision-explore: new fresh inputs and drawn examples every run
    train_seeds: int | None = None  # --precision-train-seeds: every TrainSpec's seeds (None: each spec's own)
    add_machine: bool = False  # --precision-add-machine: this machine's budgets added to existing goldens

    @classmethod
    def from_config(cls, config: pytest.Config) -> "RunOptions":
        default_device = "cuda" if torch.cuda.is_available() else "cpu"
        device = DEVICE.value(config) or default_device
        if device == "cuda" and not torch.cuda.is_available():
            raise pytest.UsageError(f"{DEVICE.name}=cuda: torch.cuda.is_available() is False on this machine")
        run_suite = bool(SUITE.value(config))
        spec = CONFIGS.value(config)
        if spec is not None and not spec.replace(",", " ").split():
            raise pytest.UsageError(f"{CONFIGS.name}={spec!r} names no config; known: {', '.join(CONFIG_IDS)}")
        try:
            configs = select_configs(spec)
            # imported only when the suite runs: a target module's import is not every run's business
            ini_targets = _import_ini_lines(parse_ini_targets, TARGETS, config) if run_suite else []
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        threshold = SPEED_THRESHOLD.value(config)
        if threshold is None:
            threshold = DEFAULT_THRESHOLD["cuda" if device.startswith("cuda") else "cpu"]
        else:
            try:
                threshold = float(str(threshold).rstrip("%")) / 100
            except ValueError:
                threshold = -1.0
            if not threshold > 0:
                raise pytest.UsageError(f"{SPEED_THRESHOLD.name}={SPEED_THRESHOLD.value(config)}: "
                                        "give a positive percentage, for example 10 or 10%")
        raw_dir = str(BASELINE_DIR.value(config) or BASELINE_DIR.default)
        if re.search(r"\s[;#]", raw_dir):
            # pytest's ini files end a value at the line's end: a comment after it is part of it
            raise pytest.UsageError(f"{BASELINE_DIR.name} = {raw_dir}: a comment after the value would name the "
                                    "directory; put it on a line of its own")
        root = Path(raw_dir)
        if not root.is_absolute():
            root = config.rootpath / root
        update = bool(UPDATE_BASELINES.value(config))
        add_machine = bool(ADD_MACHINE.value(config))
        if update and add_machine:
            raise pytest.UsageError(f"{UPDATE_BASELINES.name} rewrites the goldens, {ADD_MACHINE.name} adds this "
                                    "machine's budgets to them and keeps the rest: give one")
        if add_machine and STRICT_BUDGETS.value(config):
            raise pytest.UsageError(f"{ADD_MACHINE.name} judges each golden by the budgets it borrows from other "
                                    f"machines, which {STRICT_BUDGETS.name} refuses: give one")
        if update or add_machine:
            _check_writable(root, (UPDATE_BASELINES if update else ADD_MACHINE).name)
        timeout = parse_timeout(str(TIMEOUT.value(config)))
        explore = bool(EXPLORE.value(config))
        fresh_seed = _fresh_seed(config, explore)
        return cls(device, configs, BaselineStore(root), update, run_suite, default_device, ini_targets,
                   speed=not NO_SPEED.value(config), speed_threshold=threshold, trace=bool(TRACE.value(config)),
                   strict_budgets=bool(STRICT_BUDGETS.value(config)), audit=bool(AUDIT.value(config)),
                   parallel=_parallel(config), timeout=timeout, builtins=bool(BUILTINS.value(config)),
                   compile=bool(COMPILE.value(config)), details=any(o.value(config) for o in OUTPUT_OPTIONS),
                   fresh_seed=fresh_seed, explore=explore, train_seeds=_train_seeds(config), add_machine=add_machine)

    @functools.cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.device)

    def update_command(self, *, nodeid: str | None = None, suite_item: str | None = None, config_id: str = "") -> str:
        """The exact command that (re)writes one baseline."""
        return update_command(self, nodeid=nodeid, suite_item=suite_item, config_id=config_id)


def parse_timeout(raw: str) -> float:
    """ini ``precision_timeout``: seconds, 0 or ``inf`` for no limit (0 returned for both); a NaN,
    a negative number or anything else is a usage error naming the value."""
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise pytest.UsageError(f"{TIMEOUT.name} = {raw}: give seconds (0: no limit)")
    return 0.0 if seconds > NO_LIMIT_ABOVE else seconds  # inf, or past three years: no limit


def _import_ini_lines(parse, key: IniKey, config: pytest.Config) -> list:
    """``parse`` (the registry's reader of ``key``'s lines) one line at a time, so that a module
    that ends the process when imported (``sys.exit``, ``os._exit``) is a ValueError naming its line."""
    out, rootdir = [], str(config.rootpath)
    for raw in key.value(config):
        line = raw.split("#", 1)[0].strip()
        module = line.split(":", 1)[0]
        try:
            with refuse_process_exits(f"importing {module}", IMPORT_ADVICE):
                out += parse([raw], rootdir)
        except TargetEnded as e:
            raise ValueError(f"{key.name}: {line!r}: {e}") from None
    return out


def load_ini_kinds(config: pytest.Config) -> None:
    """Register the kinds of ini ``precision_kinds``; anything wrong with a line, its module's
    import included, is a usage error naming the line."""
    try:
        _import_ini_lines(parse_ini_kinds, KINDS, config)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def _fresh_seed(config: pytest.Config, explore: bool) -> int | None:
    """The run's fresh seed for every target: the one given; else, exploring, (an xdist worker) its
    controller's, so that every worker draws the same inputs, or a new one (``kinds.fresh.new_seed``);
    else None: each target draws from its own, derived from its code."""
    given = FRESH_SEED.value(config)
    if given is not None:
        try:
            return parse_seed(given, FRESH_SEED.name)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    if not explore:
        return None
    handed = getattr(config, "workerinput", {}).get(FRESH_SEED_KEY)
    return new_seed() if handed is None else int(handed)


def _train_seeds(config: pytest.Config) -> int | None:
    raw = TRAIN_SEEDS.value(config)
    if raw is None:
        return None
    if not (str(raw).strip().isdigit() and int(raw) >= 1):
        raise pytest.UsageError(f"{TRAIN_SEEDS.name}={raw}: give a positive number of seeds (1: one run per config)")
    return int(raw)


def _parallel(config: pytest.Config) -> str | None:
    workers = getattr(config, "workerinput", {}).get("workercount")
    # one worker (-n 1) shares the CPU with no other
    return None if workers is None or workers < 2 else f"timed by one of {workers} pytest-xdist workers sharing the CPU"


def _check_writable(root: Path, option: str = UPDATE_BASELINES.name) -> None:
    """One usage error, naming the directory, rather than one failure per case."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == root else f": {existing} is not writable"
        raise pytest.UsageError(f"{option}: cannot write to the baseline directory {root}{where}")


OPTIONS_KEY = pytest.StashKey[RunOptions]()
# the run's records: one per suite case, as the plain dict of its kinds.record.CaseRecord (summary row,
# report detail), merged across xdist workers (runner.worker_output)
RECORDS_KEY = pytest.StashKey[list]()
