"""--precision-compile (pytester): each target also runs under torch.compile, judged as the eager
one and against it in the same case. Inductor compiles C++ here: the first compile in a process
takes about 30 s on a cold cache, later ones seconds, so each session is one config and few regimes."""
import pytest

pytest_plugins = ["pytester"]
# about 50 s on 2 cores, most of it Inductor's first C++ compile
pytestmark = pytest.mark.slow(reason="Inductor compiles C++ for about 30 s before the first case")

SOFTMAX = """
import torch
import pytest_precision


def softmax(x):
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


@pytest_precision.register("mine", kind="softmax")
def mine(x):
    return softmax(x).to(x.dtype)
"""

# planted defect: only the compiled graph rounds the probabilities to multiples of 2^-12
SNEAKY = SOFTMAX + """

@pytest_precision.register("sneaky", kind="softmax")
def sneaky(x):
    y = softmax(x)
    if torch.compiler.is_compiling():
        y = torch.round(y * 4096) / 4096
    return y.to(x.dtype)
"""

@pytest.fixture(autouse=True, scope="module")
def compiled_once():
    """One compile (forward and backward, float32 and under autocast) outside the pytester sessions:
    pytester drops the modules a session imported, and Inductor's registries refuse a second import
    of theirs ("Artifact of type=autotune already registered")."""
    import warnings

    import torch

    def f(x):
        return torch.softmax(x @ x.t(), -1).sum()
    x = torch.randn(8, 8, requires_grad=True)
    with warnings.catch_warnings():  # Inductor's import: torch's own deprecation of torch.jit.script_method
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(f)
    compiled(x).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(x.detach().bfloat16())


ARGS = ("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", "--precision-configs=fp32")


def test_a_compiled_target_is_judged_beside_its_eager_run(pytester):
    pytester.makeconftest(SOFTMAX)
    written = pytester.runpytest(*ARGS, "--precision-compile", "-k", "unit or scale20 and not scale200",
                                 "--precision-update-baselines")
    written.assert_outcomes(passed=4)
    assert (pytester.path / "precision_baselines/softmax/mine/unit/fp32+compiled.npz").is_file()
    result = pytester.runpytest(*ARGS, "--precision-compile", "-k", "unit or scale20 and not scale200")
    result.assert_outcomes(passed=4)
    # the compiled row beside the eager one
    result.stdout.fnmatch_lines(["*| mine *| fp32 *|*2 |*| pass *", "*| mine *| fp32+compiled *|*2 |*| pass *"])


def test_compiled_code_that_differs_from_eager_fails_as_compiled(pytester):
    pytester.makeconftest(SNEAKY)
    result = pytester.runpytest(*ARGS, "--precision-compile", "-k", "sneaky and (unit or scale20) and not scale200")
    result.assert_outcomes(failed=4)  # no goldens yet: every case fails for that, the compiled ones also so
    result.stdout.fnmatch_lines([
        "*softmax[[]sneaky-fp32+compiled-unit[]]: FAIL underflow,accuracy,baseline,compiled (oracle: *; compiled vs "
        "eager: underflow * > 0 allowed (eager: max ULP *",
        "*eager (the target not compiled, same config): max ULP *, max abs * -> compiled budget max ULP *",
        "*if this run is right, accept it with: pytest --precision-suite -k 'softmax[[]sneaky-fp32+compiled-unit[]]' --precision-compile "
        "--precision-configs=fp32 --precision-update-baselines",
    ])
    for line in result.stdout.lines:  # the eager cases fail for their missing golden only
        assert not (line.startswith("precision-suite::softmax[sneaky-fp32-") and "compiled vs eager" in line)


def test_a_traced_call_leaves_the_compiled_target_compiled(pytester):
    """The tracer's TorchDispatchMode makes dynamo skip a code object for good: the traced call runs
    the eager code, and the next regime's compiled case still runs the compiled graph."""
    pytester.makeconftest(SNEAKY)
    result = pytester.runpytest(*ARGS, "--precision-compile", "--precision-trace", "-k",
                                "sneaky-fp32+compiled and (unit or scale20) and not scale200")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*sneaky-fp32+compiled-unit[]]: FAIL *,compiled (oracle: *compiled vs eager: *",
                                 "*sneaky-fp32+compiled-scale20[]]: FAIL *,compiled (oracle: *compiled vs eager: *"])


def test_an_op_target_compiles_with_its_gradients(pytester):
    pytester.makeconftest("""
import torch
import torch.nn.functional as F
import pytest_precision

pytest_precision.register("gelu", F.gelu, kind="op", inputs={"unit": lambda g: torch.randn(16, 64, generator=g)})
""")
    result = pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
                                "--precision-configs=fp32,bf16", "--precision-compile", "--precision-update-baselines")
    result.assert_outcomes(passed=8)
    assert "darg0" in (pytester.path / "precision_baselines/op/gelu/unit/bf16+compiled.json").read_text()


def test_without_the_option_nothing_is_compiled(pytester):
    pytester.makeconftest(SNEAKY)
    result = pytester.runpytest(*ARGS, "--collect-only", "-q")
    assert not [line for line in result.stdout.lines if "compiled" in line]
    assert any("sneaky-fp32-unit" in line for line in result.stdout.lines)
    compiled = pytester.runpytest(*ARGS, "--precision-compile", "--collect-only", "-q")
    assert any("sneaky-fp32+compiled-unit" in line for line in compiled.stdout.lines)


@pytest.mark.parametrize("kind", ["train_step"])
def test_kinds_whose_runs_are_not_one_call_have_no_compiled_variant(kind):
    from pytest_precision.kinds import registry

    assert not registry.get_kind(kind).compiles
    assert registry.get_kind("softmax").compiles and registry.get_kind("op").compiles
