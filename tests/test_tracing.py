"""Op tracing, first-fault localisation against the float64 run, and the autocast audit."""
import pytest
import torch

from pytest_precision.explain.audit import audit
from pytest_precision.explain.faults import first_fault
from pytest_precision.explain.tracing import render_trace, trace

pytest_plugins = ["pytester"]


def test_trace_records_forward_and_backward_with_dtypes_counts_and_lines():
    x = torch.tensor([1.0, 12.0, -3.0], requires_grad=True)

    def step():
        y = x.half().exp()  # e^12 = 1.6e5 overflows fp16 (max 65504)
        y.float().sum().backward()
    records = trace(step)
    ops = [(r.op, r.phase.split(" ")[0]) for r in records]
    assert ("aten::exp", "forward") in ops and any(p == "backward" for _, p in ops)
    exp = next(r for r in records if r.op == "aten::exp")
    assert exp.in_dtypes == ("float16",) and exp.out_dtypes == ("float16",) and exp.nonfinite == 1
    assert exp.where.startswith("test_tracing.py:") and exp.inputs_finite
    backward = [r for r in records if r.phase.startswith("backward")]
    assert any(r.where == exp.where for r in backward)  # attributed to the forward line
    table = render_trace(records)
    assert "aten::exp" in table and "float16" in table and "non-finite" in table


def test_overflow_is_named_with_the_reference_value():
    x = torch.tensor([[1.0, 12.0, -3.0]])
    fault = first_fault(lambda: x.half().exp(), lambda: x.double().exp())
    assert fault.op == "aten::exp" and fault.kind == "overflow" and fault.produced == "inf"
    assert abs(fault.reference - 162754.79) < 1  # e^12
    assert "where the reference is 1.63e+05" in fault.describe("fp16")
    assert first_fault(lambda: x.exp(), lambda: x.double().exp()) is None  # fp32 holds e^12


def test_log_of_an_underflowed_probability_names_the_log_and_the_underflow():
    x = torch.tensor([[0.0, -120.0]])

    def log_softmax(t):
        return torch.softmax(t, -1).log()
    fault = first_fault(lambda: log_softmax(x), lambda: log_softmax(x.double()))
    assert fault.op == "aten::log" and fault.kind == "underflow" and fault.produced == "-inf"
    assert abs(fault.reference + 120.0) < 1e-9
    assert "the 0 came from aten::_softmax at" in fault.cause and "reference is 7.67e-53" in fault.cause


def test_nan_where_the_exact_result_is_nan_is_not_a_fault():
    x = torch.tensor([[-float("inf"), -float("inf")], [1.0, 2.0]])
    assert first_fault(lambda: torch.softmax(x, -1), lambda: torch.softmax(x.double(), -1)) is None


def test_gradient_underflow_in_backward_is_named_at_its_forward_line():
    """An fp16 layer under a small fp32 loss, no scaler: forward values are fine, the weight's
    gradient (1e-4 x 1e-4) underflows to 0 in the backward pass; the float64 run keeps it."""
    def step(dtype):
        w = torch.ones(4, dtype=dtype, requires_grad=True)
        x = torch.full((4,), 1e-4, dtype=dtype)
        y = w * x  # the layer
        loss = y.to(torch.promote_types(dtype, torch.float32)).sum() * 1e-4
        loss.backward()
    fault = first_fault(lambda: step(torch.float16), lambda: step(torch.float64))
    assert fault is not None and fault.kind == "underflow" and fault.produced == "0"
    assert fault.op == "aten::mul" and fault.phase == "backward (MulBackward0)"
    assert fault.where == f"test_tracing.py:{step.__code__.co_firstlineno + 3}"  # the layer's line
    assert abs(fault.reference - 1e-8) < 1e-12  # below fp16's smallest subnormal, 6e-8


def test_audit_shows_cpu_autocast_keeps_softmax_in_bf16_for_bf16_scores():
    """On the CPU, a softmax of the bf16 scores a matmul produced under autocast stays
    bf16 (on CUDA autocast runs it in fp32); the audit shows it and flags it."""
    q = torch.randn(8, 16)

    def attention_scores():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.softmax(q @ q.T, -1)
    a = audit(attention_scores, autocast=True)
    ran = {(row[0], row[3]) for row in a["ops"]}
    assert ("aten::mm", "bfloat16") in ran and ("aten::_softmax", "bfloat16") in ran
    assert any("aten::_softmax" in f and "ran in bfloat16" in f for f in a["flags"])
    assert not any("ran in float32 under autocast" in f for f in a["flags"])


def test_audit_of_a_correct_fp32_softmax_has_no_flags():
    x = torch.randn(4, 8)
    assert audit(lambda: torch.softmax(x, -1), autocast=False)["flags"] == []


def test_audit_flags_a_half_cast_before_softmax_in_a_real_session(pytester):
    pytester.makeini("[pytest]\n")
    pytester.makeconftest("""
import torch
import pytest_precision

@pytest_precision.register("halved", kind="softmax")
def halved(x):
    return torch.softmax(x.half(), -1).to(x.dtype)  # the planted cast
""")
    r = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "--precision-no-speed", "--precision-audit",
                           "--precision-configs=fp32,amp-bf16", "--precision-update-baselines", "-k", "softmax and unit")
    r.assert_outcomes(failed=2)  # fp16 arithmetic is far outside an fp32 config's budgets
    r.stdout.fnmatch_lines([
        "*precision audit: the dtype each op ran in*",
        "halved [[]amp-bf16[]] (unit inputs):",
        "*| aten::_softmax *| forward *| float16 *| float16 *| conftest.py:6 *|*",
        "  FLAG aten::_softmax at conftest.py:6 ran in float16: its reduction needs fp32 range and precision",
        "  FLAG cast to float16 in user code at conftest.py:6: the ops after it run in 16 bits whatever the config asks",
    ])


def test_precision_trace_prints_each_case_and_puts_it_in_failures(pytester):
    pytester.makeini("[pytest]\n")
    pytester.makeconftest("""
import torch
import pytest_precision

@pytest_precision.register("naive", kind="softmax")
def naive(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)
""")
    args = ("--precision-suite", "-p", "no:cacheprovider", "--precision-no-speed", "--precision-configs=fp16")
    pytester.runpytest(*args, "--precision-update-baselines", "-k", "softmax and (unit or sharp-peak)")
    r = pytester.runpytest(*args, "--precision-trace", "-k", "softmax and (unit or sharp-peak)")
    r.assert_outcomes(passed=1, failed=1)  # sharp-peak overflows: e^30 in fp16
    r.stdout.fnmatch_lines([
        "*op trace:*",
        "*precision trace (2 case(s))*",
        "softmax[[]naive-fp16-sharp-peak[]]:",
        "*| aten::exp *| forward *| float16 *| float16 *| *4096 | *16 | *| conftest.py:6 |",
        "softmax[[]naive-fp16-unit[]]:",
    ])


def test_an_allocation_is_never_the_fault_and_a_destination_is_no_input():
    """An uninitialised buffer may hold NaN: ``empty`` produced nothing, and ``copy_`` or an
    ``out=`` op does not read what its destination held before."""
    from pytest_precision.explain.faults import locate
    from pytest_precision.platform.launches import as_harness
    from pytest_precision.explain.tracing import OpRecord

    x = torch.tensor([1.0, 12.0, -3.0])
    with as_harness():  # the harness's own ops are not traced: stands for memory that held NaN
        garbage = torch.full((3,), float("nan"))

    def run():
        buf = garbage  # a buffer whose old contents are NaN
        buf.copy_(x)
        torch.add(x, 1.0, out=buf)
        return buf.half().exp()  # e^13 overflows fp16
    records = trace(run, keep_outputs=True)
    copy = next(r for r in records if r.op == "aten::copy_")
    out = next(r for r in records if r.op == "aten::add")
    assert copy.inputs_finite and out.inputs_finite  # the NaN destination is not what they read
    fault = first_fault(run, lambda: (x.double() + 1).exp())
    assert fault.op == "aten::exp" and fault.kind == "overflow"

    def record(i, op, nonfinite, inputs_finite, output):
        return OpRecord(i, op, "forward", (), ("float32",), output.numel(), nonfinite, 0, 0.0, "here.py:1",
                        inputs_finite, False, output=output)
    nan_buffer = record(0, "aten::empty", 3, True, torch.full((3,), float("nan")))
    overflow = record(1, "aten::exp", 1, True, torch.tensor([1.0, float("inf"), 2.0]))
    assert locate([nan_buffer, overflow]).op == "aten::exp"
    assert locate([nan_buffer]) is None


def test_a_constant_is_not_the_fault():
    """SDPA's math path builds its -inf mask value with scalar_tensor: a constant computes nothing
    from finite inputs, and neither does full_like, which reads only its argument's shape."""
    x = torch.tensor([1.0, 13.0, -3.0])

    def run():
        masked = torch.scalar_tensor(float("-inf"))
        nan_like = torch.full_like(x, float("nan"))
        return x.half().exp(), masked, nan_like  # e^13 overflows fp16
    fault = first_fault(run)
    assert fault is not None and fault.op == "aten::exp" and fault.kind == "overflow", fault


def test_each_reference_attempt_is_traced_on_its_own():
    """A float64 re-run abandoned halfway (the target refused float64 after some ops) leaves none of
    its ops in the trace the fault is compared with: the float32 attempt's values are what it reads."""
    x = torch.tensor([1.0, 12.0, -3.0])

    def refuses_float64():
        (x.double() * 0).exp()  # ops of the abandoned attempt, with other values
        raise NotImplementedError("float64 is not supported")
    fault = first_fault(lambda: x.half().exp(), (refuses_float64, lambda: x.float().exp()))
    assert fault.op == "aten::exp" and abs(fault.reference - 162754.79) < 1, fault

    class Stop(BaseException):  # stands for the case's time limit: no later attempt runs
        pass
    ran = []

    def times_out():
        raise Stop()
    with pytest.raises(Stop):
        first_fault(lambda: x.half().exp(), (times_out, lambda: ran.append(1)))
    assert not ran
