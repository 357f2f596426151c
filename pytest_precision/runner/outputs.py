"""What a run leaves behind besides the terminal table: the JSON and Markdown reports, the plots,
and the unused-baselines list. A pytest plugin object registered by plugin.py, so that its hooks
run on the controller after every xdist worker's records have been merged.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ..baselines.usage import (CACHE_KEY, PRUNE_COMMAND, USAGE_KEY, BaselineUsage, find_unused, incomplete_reason,
                               module_prefix)
from ..kinds.registry import kind_names, kinds
from ..numerics.configs import CONFIGS
from ..platform.devices import numerics_key
from ..reporting.plots import MISSING_MESSAGE as PLOTS_MISSING, plots_available
from .option_table import PLOTS, REPORT, REPORT_MD, Option
from .options import OPTIONS_KEY, RECORDS_KEY

__all__ = ["RunOutputs"]


def _path_option(config: pytest.Config, option: Option) -> Path | None:
    value = option.value(config)
    if not value:
        return None
    p = Path(value)
    return p if p.is_absolute() else Path(config.invocation_params.dir) / p



def _config_ids() -> set[str]:
    """Every config id a golden can be of: the matrix's, each kind's own (the training recipes) and
    ``default`` (a ``golden`` check outside ``precision_config``)."""
    matrix = list(CONFIGS.values())
    return {*CONFIGS, "default", *(getattr(c, "id", c) for kind in kinds() for c in kind.configs(matrix))}

class RunOutputs:
    def __init__(self, config: pytest.Config):
        if PLOTS.value(config) and not plots_available():
            raise pytest.UsageError(PLOTS_MISSING)  # at start-up, not after a long run
        self.config = config
        usage = BaselineUsage(whole_project=config.args_source != pytest.Config.ArgsSource.ARGS)
        config.stash[USAGE_KEY] = usage
        self.lines: list[str] = []  # for the terminal, after the summary table

    @property
    def usage(self) -> BaselineUsage:
        return self.config.stash[USAGE_KEY]

    def pytest_deselected(self, items) -> None:
        for item in items:
            if item.get_closest_marker("precision"):
                self.usage.excuse(item)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.usage.module_prefixes |= {module_prefix(i.nodeid) for i in session.items
                                       if not i.nodeid.startswith("precision-suite")}
        # a collected suite case keeps its golden whatever becomes of it (skipped, crashed before
        # its lookup); a user test keeps its goldens unless it passes (runtest_logreport)
        self._user_tests = {}
        for item in session.items:
            if getattr(item, "case", None) is not None:
                self.usage.excuse(item)
            elif item.get_closest_marker("precision"):
                self._user_tests[item.nodeid] = item

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        item = getattr(self, "_user_tests", {}).get(report.nodeid)
        if item is not None and (report.failed or report.skipped):
            self.usage.excuse(item)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        state = self.config.stash[OPTIONS_KEY]
        self.usage.used |= state.store.used
        if hasattr(self.config, "workeroutput"):  # an xdist worker: it hands its usage over (runner.worker_output)
            return
        if state.run_suite:
            self._unused_baselines(state, session, exitstatus)
        self._reports(state, self.config.stash[RECORDS_KEY])

    def _unused_baselines(self, state, session, exitstatus) -> None:
        cache = getattr(self.config, "cache", None)
        reason = incomplete_reason(self.usage, exitstatus, session.testsfailed, self.config.getoption("maxfail"))
        if reason:
            self.lines.append(f"unused baselines not checked: {reason}")
            if cache is not None:
                cache.set(CACHE_KEY, {"root": str(state.store.root), "unused": None, "reason": reason})
            return
        known = _config_ids()
        exists = lambda config: config.split("+", 1)[0] in known  # noqa: E731 (a variant's +backend, +compiled)
        unused = find_unused(state.store.root, self.usage, suite_ran=True, kinds=set(kind_names()), config_exists=exists)
        if cache is not None:
            cache.set(CACHE_KEY, {"root": str(state.store.root), "unused": unused})
        if unused:
            how = (f"remove with {PRUNE_COMMAND}" if cache is not None else
                   f"to remove them, run again without -p no:cacheprovider (the list is kept in its cache), then {PRUNE_COMMAND}")
            self.lines.append(f"{len(unused)} unused baseline(s) under {state.store.root} (no test used them in "
                              f"this run); {how}:")
            self.lines += [f"  {name}" + ("" if exists(name.rsplit("/", 1)[-1]) else
                                          f" (no kind has a config {name.rsplit('/', 1)[-1]!r}: no run uses it)")
                           for name in unused]

    def _reports(self, state, records: list[dict]) -> None:
        from ..reporting.report import build_report, render_markdown, write_json_report, write_markdown_report

        configs = [c.id for c in state.configs]
        key = numerics_key(state.device)
        notes = list(self.lines)  # the unused-baselines lines, not the "written to" ones below
        path = _path_option(self.config, REPORT)
        if path is not None:
            write_json_report(path, build_report(records, device=state.device, numerics_key=key,
                                                 fingerprint=state.fingerprint, torch_version=torch.__version__,
                                                 configs=configs))
            self.lines.append(f"precision report (JSON) written to {path}")
        path = _path_option(self.config, REPORT_MD)
        if path is not None:
            write_markdown_report(path, render_markdown(records, config_order=configs, device=state.device,
                                                        numerics_key=key, fingerprint=state.fingerprint,
                                                        extra_lines=notes))
            self.lines.append(f"precision report (Markdown) written to {path}")
        directory = _path_option(self.config, PLOTS)
        if directory is not None:
            from ..reporting.plots import write_plots

            written = write_plots(records, directory, configs)
            self.lines.append(f"precision plots: {len(written)} PNG file(s) written to {directory}")

    @pytest.hookimpl(trylast=True)  # after plugin.py's summary table
    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.lines:
            terminalreporter.write_line(line)
