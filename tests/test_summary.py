"""summary: one row per target and config, worst case of each column, failures counted."""
from pytest_precision.reporting.summary import HEADERS, summary_rows, render_summary


def rec(target, config, ulp, passed=True, cats=(), nan=0):
    return {"target": target, "config": config, "regime": "r", "max_ulp": ulp, "max_rel": ulp / 10,
            "sqnr_db": 100 - ulp, "overflow": 0, "underflow": 1, "nan": nan, "passed": passed,
            "categories": list(cats)}


def test_rows_aggregate_per_target_and_config_in_matrix_order():
    records = [rec("b", "fp16", 3), rec("a", "fp16", 1), rec("a", "fp32", 2), rec("a", "fp16", 5, False, ["overflow"], nan=2)]
    rows = summary_rows(records, ["fp32", "fp16"])
    assert rows == [
        ("a", "fp32", 1, "2", "0.2", "98", 0, 1, 0, "pass"),
        ("a", "fp16", 2, "5", "0.5", "95", 0, 2, 2, "FAIL 1/2: overflow"),
        ("b", "fp16", 1, "3", "0.3", "97", 0, 1, 0, "pass"),
    ]
    table = render_summary(records, ["fp32", "fp16"])
    assert all(h in table.splitlines()[0] for h in HEADERS)
    assert len(table.splitlines()) == 2 + 3


def test_skipped_configs_are_shown_with_their_reason():
    records = [{"target": "a", "config": "tf32", "regime": "r", "skipped": "tf32: no CUDA"}, rec("a", "fp32", 1)]
    rows = summary_rows(records, ["fp32", "tf32"])
    assert rows[1] == ("a", "tf32", 0, "-", "-", "-", "-", "-", "-", "skip: tf32: no CUDA")


def test_timed_and_cuda_runs_add_speed_and_memory_against_fp32():
    def timed(config, regime, t, peak=None):
        return {**rec("a", config, 1), "regime": regime, "time_s": t, "peak_bytes": peak}
    cpu = [timed("fp32", "r1", 2e-3), timed("fp32", "r2", 2e-3), timed("bf16", "r1", 1e-3), timed("bf16", "r2", 1e-3)]
    lines = render_summary(cpu, ["fp32", "bf16"]).splitlines()
    assert "| time " in lines[0] and "vs fp32" in lines[0] and "peak memory" not in lines[0]
    assert "2.00 x" in lines[3] and "2 ms" in lines[3] and "1.00 x" in lines[2]
    cuda = [timed("fp32", "r1", 2e-3, 4 << 20), timed("bf16", "r1", 1e-3, 1 << 20)]
    lines = render_summary(cuda, ["fp32", "bf16"]).splitlines()
    assert "peak memory" in lines[0] and "saved vs fp32" in lines[0]
    assert "| 1 MiB " in lines[3] and "75 %" in lines[3] and "| 0 %" in lines[2]


def test_a_busy_machines_loads_are_one_sentence_with_their_range():
    from pytest_precision.reporting.summary import speed_lines

    busy = "a busy machine: other processes used {:.2f} cores; only a slowdown past 2.0 x fails there"
    records = [{"target": "t", "config": "fp32", "regime": f"r{i}", "speed_status": "shared", "speed_ratio": 1.3,
                "speed_shared": busy.format(load)} for i, load in enumerate((1.30, 1.35, 1.33))]
    (line,) = speed_lines(records, "cpu")
    assert line.count("a busy machine") == 1
    assert "other processes used 1.30 to 1.35 cores; only a slowdown past 2.0 x fails there" in line


def test_a_passing_case_with_nothing_finite_to_measure_does_not_make_its_row_nan():
    # cross_entropy's all-ignored batch: the expected loss is NaN and the output is NaN, nothing to measure
    nothing = {**rec("a", "fp32", float("nan")), "max_rel": float("nan"), "sqnr_db": float("nan"), "underflow": 0}
    rows = summary_rows([rec("a", "fp32", 2), nothing], ["fp32"])
    assert rows[0][3:6] == ("2", "0.2", "98")
    assert summary_rows([nothing], ["fp32"])[0][3:6] == ("-", "-", "-")
    # a case that failed, or produced NaN where a value was expected, still makes the cell NaN
    broken = {**nothing, "passed": False, "categories": ["nan"], "nan": 3}
    assert summary_rows([rec("a", "fp32", 2), broken], ["fp32"])[0][3:6] == ("nan", "nan", "nan")
    # a log-domain output at -inf within its budget counts as underflow: its SQNR was not measured
    underflowed = {**rec("a", "fp32", 1), "sqnr_db": float("nan"), "underflow": 2}
    assert summary_rows([rec("a", "fp32", 2), underflowed], ["fp32"])[0][5] == "nan"
