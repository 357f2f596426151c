"""pytest hooks of pytest-precision. Only wiring: the work is in the modules named below."""
from __future__ import annotations

import time

import pytest

from .kinds.fresh import seed_line
from .kinds import registry
from .kinds.session import RunState
from .platform.devices import numerics_key, pin_xdist_worker
from .reporting.summary import write_terminal_summary
from .runner import option_table, worker_output
from .runner.collection import RUN_STATE_KEY, SuiteCollector, keyword_expressions
from .runner.fixtures import (CALL_REPORT, golden, parametrize_precision_config,  # noqa: F401 (fixtures)
                              precision_config)
from .runner.exits import watch_threads
from .runner.options import FRESH_SEED_KEY, OPTIONS_KEY, RECORDS_KEY, RunOptions, load_ini_kinds
from .runner.outputs import RunOutputs
from .runner.variants import SharedDecisions


def pytest_addoption(parser: pytest.Parser) -> None:
    option_table.add_to(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """The session's own registry of targets and kinds (kinds.registry; closed as the session's
    config is cleaned up, configured or not), then the ini kinds, before the conftests, whose
    targets may be of those kinds."""
    session = registry.open_session()
    early_config.add_cleanup(lambda: registry.close_session(session))
    load_ini_kinds(early_config)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "precision: a numerical precision check (suite case or user test)")
    config.addinivalue_line("markers", "precision_suite: a case of the built-in suites (--precision-suite)")
    options = RunOptions.from_config(config)
    pin_xdist_worker(options.device)  # before the fingerprint or any CUDA work of this worker
    config.stash[OPTIONS_KEY] = options
    config.stash[RECORDS_KEY] = []
    config.stash[worker_output.STARTED_KEY] = time.time()
    # what the cases learn for later ones, dropped with the session; the fresh seed of the run
    config.stash[RUN_STATE_KEY] = RunState(fresh_seed=options.fresh_seed, train_seeds=options.train_seeds,
                                           explore=options.explore)
    if options.device.startswith("cuda"):
        _install_fused_statistics(config)
    config.pluginmanager.register(RunOutputs(config), "precision-outputs")
    if options.run_suite:
        watch_threads(config)  # names the threads the targets leave running
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(config), "precision-xdist")


def pytest_report_header(config: pytest.Config) -> str | None:
    """Where the fresh regime's inputs come from, and how to replay them (the controller's seed, when
    exploring: the workers draw from it)."""
    options = config.stash[OPTIONS_KEY]
    return seed_line(options.fresh_seed, options.explore) if options.run_suite else None


def _install_fused_statistics(config: pytest.Config) -> None:
    """On CUDA the comparison's statistics come from the project's Triton kernel (one pass), until
    the session ends (what was there before is put back: a session inside another)."""
    from .numerics.metrics import restore_fused_statistics
    from .platform.triton import triton_installed

    if triton_installed():
        from .kernels import error_stats

        previous = error_stats.install()
        config.add_cleanup(lambda: restore_fused_statistics(previous))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "precision_config" in metafunc.fixturenames:
        parametrize_precision_config(metafunc)


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to suite items too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    for item in items:
        if "precision_config" in getattr(item, "fixturenames", ()) or "golden" in getattr(item, "fixturenames", ()):
            item.add_marker("precision")
    if config.stash[OPTIONS_KEY].run_suite:
        collector = SuiteCollector.from_parent(session, name="precision-suite", nodeid="precision-suite")
        report = collector.ihook.pytest_make_collect_report(collector=collector)
        collector.ihook.pytest_collectreport(report=report)  # counted in "collected N items"
        items.extend(report.result)
        keyword_expressions(items)  # the -k expression each suite case prints, once every item is known


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """The call's report, for the golden fixture to see at teardown whether its test passed."""
    report = yield
    if report.when == "call":
        item.stash[CALL_REPORT] = report
    return report


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """pytest-benchmark's machine id ignores the GPU: add the device fingerprint our speed
    records are keyed by, so --benchmark-compare can tell two GPUs apart."""
    options = config.stash[OPTIONS_KEY]
    machine_info["pytest_precision"] = {"fingerprint": options.fingerprint, "numerics_key": numerics_key(options.device)}


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    options, records = config.stash[OPTIONS_KEY], config.stash[RECORDS_KEY]
    written = config.stash.get(worker_output.WRITTEN_KEY, [])
    if options.update and config.stash.get(worker_output.STARTED_KEY, None) is not None:
        listed = written + [r["baseline_update"] for r in records if r.get("baseline_update")]
        written = written + worker_output.unlisted_goldens(options.store.root, config.stash[worker_output.STARTED_KEY],
                                                           listed)
    write_terminal_summary(terminalreporter, options, records, written)


class _XdistController:
    """Hands each worker's output (records, baseline usage) to the controller (``runner.worker_output``),
    and gives the workers the run's fresh seed and one directory to share the run's variant decisions
    in (``runner.variants``)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.decisions = SharedDecisions()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        options = node.config.stash[OPTIONS_KEY]
        if options.fresh_seed is not None:  # every worker draws the controller's fresh inputs
            node.workerinput[FRESH_SEED_KEY] = options.fresh_seed
        if options.run_suite:
            self.decisions.hand_to(node.workerinput)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.decisions.remove()

    @pytest.hookimpl(trylast=True)  # after RunOutputs has counted the goldens the worker used
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workeroutput"):  # a worker: the controller prints and writes
            worker_output.hand_over(session.config)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        worker_output.take_from(node.config, node, error)

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" and not hasattr(self.config, "workeroutput"):
            worker_output.take_written(self.config, report)
