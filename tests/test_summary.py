"""summary: one row per target and config, worst case of each column, failures counted."""
from pytest_precision.summary import HEADERS, summary_rows, render_summary


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
