"""pytest hooks of pytest-precision. Only wiring: the work is in the modules named below."""
from __future__ import annotations

import pytest

from .kinds.registry import clear as clear_targets, forget_project_kinds
from .platform.devices import numerics_key, pin_xdist_worker
from .reporting.summary import write_terminal_summary
from .kinds.session import RunState
from .runner.collection import RUN_STATE_KEY, SuiteCollector, keyword_expressions
from .runner.fixtures import (CALL_REPORT, golden, parametrize_precision_config,  # noqa: F401 (fixtures)
                              precision_config)
from .runner.exits import watch_threads
from .runner.options import OPTIONS_KEY, RECORDS_KEY, RunOptions, load_ini_kinds
from .runner.outputs import RunOutputs, add_output_options
from .runner.timelimit import DEFAULT_TIMEOUT
from .runner.variants import SharedDecisions

WORKER_RECORDS = "precision_records"  # xdist workeroutput key


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("precision", "numerical precision checks (pytest-precision)")
    group.addoption("--precision-suite", action="store_true",
                    help="run the suites on the registered targets (the built-in targets when none is registered)")
    group.addoption("--precision-builtins", action="store_true",
                    help="also run the built-in targets (torch's ops, the project's Triton kernels, tiny_gpt) beside "
                         "the registered ones, for comparison (with nothing registered they run anyway)")
    group.addoption("--precision-compile", action="store_true",
                    help="also run each target under torch.compile in every config (config ids +compiled), judged "
                         "like the eager one and against it")
    group.addoption("--precision-update-baselines", action="store_true",
                    help="write golden baselines (atomically) and print old vs new budgets")
    group.addoption("--precision-configs", metavar="ID,ID",
                    help="configs to run: fp32,tf32,fp16,bf16,amp-fp16,amp-bf16,fp8-e4m3 (default: all the device "
                         "runs); the training suite runs the recipes of each (amp-fp16: with and without a "
                         "GradScaler; bf16: pure bf16, with stochastic rounding, DDP's bf16 hook; fp16: DDP's fp16 hook)")
    group.addoption("--precision-device", choices=("cpu", "cuda"),
                    help="device to run on (default: cuda when available, else cpu)")
    group.addoption("--precision-no-speed", action="store_true",
                    help="do not time suite cases: no speed or memory gate, no speed records written, no "
                         "tensor-core alignment lint")
    group.addoption("--precision-trace", action="store_true",
                    help="trace every suite case op by op (forward and backward: dtypes, non-finite and zero "
                         "counts, max |out|, source line) and print the traces")
    group.addoption("--precision-audit", action="store_true",
                    help="print, per target and config, the dtype each op really ran in, and flag matmuls "
                         "left in fp32 under autocast, softmax/norms/losses in 16 bits and explicit 16-bit casts")
    group.addoption("--precision-strict-budgets", action="store_true",
                    help="a machine with no regression budget of its own fails its cases instead of being judged "
                         "by the widest budget of other machines (scaled by its peer error)")
    group.addoption("--precision-speed-threshold", metavar="PERCENT",
                    help="fail a case this much slower than its recorded median, when clear of the noise "
                         "(default: 10 on CUDA, 20 on CPU)")
    parser.addini("precision_baseline_dir", "directory of golden baselines, relative to the rootdir",
                  default="precision_baselines")
    parser.addini("precision_targets", "targets as 'package.module:function kind' lines", type="linelist", default=[])
    parser.addini("precision_kinds", "kinds as 'package.module:KIND' lines (pytest_precision.Kind objects)",
                  type="linelist", default=[])
    parser.addini("precision_timeout", "seconds a suite case may run before it fails with the stack where it was "
                  f"(0 or inf: no limit; pytest-timeout's timeout marker on a case replaces it); default {DEFAULT_TIMEOUT:g}",
                  default=str(DEFAULT_TIMEOUT))
    add_output_options(group)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """ini kinds before the conftests, whose targets may be of those kinds."""
    load_ini_kinds(early_config)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "precision: a numerical precision check (suite case or user test)")
    config.addinivalue_line("markers", "precision_suite: a case of the built-in suites (--precision-suite)")
    options = RunOptions.from_config(config)
    pin_xdist_worker(options.device)  # before the fingerprint or any CUDA work of this worker
    config.stash[OPTIONS_KEY] = options
    config.stash[RECORDS_KEY] = []
    config.stash[RUN_STATE_KEY] = RunState()  # what the cases learn for later ones, dropped with the session
    if options.device.startswith("cuda"):
        _install_fused_statistics()
    config.pluginmanager.register(RunOutputs(config), "precision-outputs")
    if options.run_suite:
        watch_threads(config)  # names the threads the targets leave running
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(), "precision-xdist")


def _install_fused_statistics() -> None:
    """On CUDA the comparison's statistics come from the project's Triton kernel (one pass)."""
    from .platform.triton import triton_installed

    if triton_installed():
        from .kernels import error_stats

        error_stats.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    clear_targets()  # registrations belong to one session (pytester runs several in one process)
    forget_project_kinds()


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


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the table
        workeroutput[WORKER_RECORDS] = session.config.stash[RECORDS_KEY]


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """pytest-benchmark's machine id ignores the GPU: add the device fingerprint our speed
    records are keyed by, so --benchmark-compare can tell two GPUs apart."""
    options = config.stash[OPTIONS_KEY]
    machine_info["pytest_precision"] = {"fingerprint": options.fingerprint, "numerics_key": numerics_key(options.device)}


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    write_terminal_summary(terminalreporter, config.stash[OPTIONS_KEY], config.stash[RECORDS_KEY])


class _XdistController:
    """Merges the workers' records on the controller (as syrupy does with workeroutput), and gives
    the workers one directory to share the run's variant decisions in (``runner.variants``)."""

    def __init__(self):
        self.decisions = SharedDecisions()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        if node.config.stash[OPTIONS_KEY].run_suite:
            self.decisions.hand_to(node.workerinput)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.decisions.remove()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        records = getattr(node, "workeroutput", {}).get(WORKER_RECORDS, [])
        node.config.stash[RECORDS_KEY].extend(records)
