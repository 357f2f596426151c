"""The Kind seam: one conformance check over every kind (built-in and a project's own), and a new
kind added as one module plus one line, run end to end by the suite."""
import textwrap

import pytest
import torch

import pytest_precision
from pytest_precision.kinds import registry
from pytest_precision.kinds.cases import NO_VARIANT, Case
from pytest_precision.kinds.kind import Kind
from pytest_precision.kinds.target import Target
from pytest_precision.numerics.configs import CONFIGS
from pytest_precision.testing import check_kind

pytest_plugins = ["pytester"]

# A whole new kind: one module. ``logsumexp`` over the last dimension.
LOGSUMEXP_KIND = '''
import torch
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


def _regime(name, description, scale, shift=0.0):
    make = lambda seed: seeded_normal(torch.Generator().manual_seed(seed), 8, 64, scale=scale, shift=shift)
    return pytest_precision.Regime(name, description, make, base_seed=7, parameters={"scale": scale, "shift": shift})


class LogSumExp(pytest_precision.TensorKind):
    name = "logsumexp"
    contract = "fn(x) -> logsumexp over the last dimension, shape x.shape[:-1], x's dtype"
    regimes = {r.name: r for r in (_regime("unit", "N(0, 1)", 1.0), _regime("large", "N(100, 10^2)", 10.0, 100.0))}

    def floating_inputs(self, x):
        return {"x": x}

    def invoke(self, fn, values, x, device):
        return fn(values["x"])

    def expected_shape(self, values, x):
        return tuple(values["x"].shape[:-1])

    def reference(self, x):
        return torch.logsumexp(x, -1)

    def peer(self, x):
        return torch.logsumexp(x, -1)

    def default_targets(self):
        return [pytest_precision.Target("torch.logsumexp", self.peer, self.name, origin="built-in")]


KIND = LogSumExp()
'''


@pytest.fixture
def example_kind(tmp_path, monkeypatch):
    (tmp_path / "logsumexp_kind.py").write_text(LOGSUMEXP_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    kind = registry.register_kind("logsumexp_kind:KIND")
    yield kind
    registry.forget_project_kinds()


def _example_target(kind: Kind) -> Target:
    """A target of ``kind`` to run it through: its trusted peer, or (the op kind, whose regimes and
    peer are each target's) a GELU declared with its inputs, or (the training kind) its built-in one."""
    if kind.name == "op":
        declared = kind.declare("gelu", {"inputs": {"unit": lambda g: torch.randn(8, 64, generator=g)}})
        return Target("gelu", torch.nn.functional.gelu, "op", declared=declared)
    if kind.name == "train_step":
        return kind.default_targets()[0]
    return Target("peer", kind.peer, kind.name)


@pytest.mark.parametrize("name", list(registry.BUILTIN_KINDS))
def test_every_builtin_kind_conforms(name):
    kind = registry.get_kind(name)
    check_kind(kind, _example_target(kind))


def test_a_project_kind_conforms(example_kind):
    check_kind(example_kind, _example_target(example_kind))


def test_kinds_are_named_and_refused_clearly(example_kind):
    with pytest.raises(ValueError, match="unknown kind 'norm'.*known kinds: softmax, log_softmax, attention, "
                                         "train_step, layer_norm, rms_norm, cross_entropy, op, logsumexp"):
        pytest_precision.register("mine", torch.exp, kind="norm")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_kind(type(example_kind)())
    with pytest.raises(ValueError, match="built-in"):
        registry.register_kind(type(registry.get_kind("softmax"))(log=False))
    with pytest.raises(TypeError, match="not a pytest_precision.Kind"):
        registry.register_kind(object())


def test_an_installed_kind_is_found_through_its_entry_point(tmp_path, monkeypatch):
    from importlib.metadata import EntryPoint

    (tmp_path / "logsumexp_kind.py").write_text(LOGSUMEXP_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint("logsumexp", "logsumexp_kind:KIND", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_PATHS", {})
    monkeypatch.setattr(registry, "_LOADED", dict(registry._LOADED))
    assert "logsumexp" in registry.kind_names()
    assert registry.get_kind("logsumexp").contract.startswith("fn(x) -> logsumexp")


CORRECT = "def mine(x):\n    return torch.logsumexp(x.float(), -1).to(x.dtype)\n"
NAIVE = "def mine(x):\n    return torch.log(torch.exp(x).sum(-1))\n"  # exp overflows past 88 in fp32


@pytest.mark.parametrize("how", ["conftest", "ini"])
def test_a_new_kind_is_one_module_and_one_line(pytester, how):
    pytester.makepyfile(logsumexp_kind=LOGSUMEXP_KIND)
    registration = "import torch\nimport pytest_precision\n"
    if how == "conftest":
        registration += 'pytest_precision.register_kind("logsumexp_kind:KIND")\n'
    else:
        pytester.makeini("[pytest]\nprecision_kinds = logsumexp_kind:KIND\n")
    pytester.makeconftest(registration + CORRECT.replace("def mine", '@pytest_precision.register("mine", kind="logsumexp")\ndef mine'))
    args = ["--precision-suite", "--precision-no-speed", "--precision-configs=fp32,bf16", "-p", "no:cacheprovider",
            "-k", "logsumexp"]
    written = pytester.runpytest(*args, "--precision-update-baselines")
    written.assert_outcomes(passed=6)
    assert (pytester.path / "precision_baselines/logsumexp/mine/large/fp32.npz").is_file()
    passed = pytester.runpytest(*args)
    passed.assert_outcomes(passed=6)
    passed.stdout.fnmatch_lines(["*precision summary*", "*| mine *| fp32 *|*3 |*| pass *"])

    pytester.makeconftest(registration + NAIVE.replace("def mine", '@pytest_precision.register("mine", kind="logsumexp")\ndef mine'))
    failed = pytester.runpytest(*args)
    failed.assert_outcomes(passed=4, failed=2)  # its fresh draws (a kind's default: its first regime's generator) stay below 88
    failed.stdout.fnmatch_lines(["*logsumexp[[]mine-fp32-large[]]: FAIL overflow*",
                                 "*first overflow in aten::exp at conftest.py:* under fp32: produced inf from finite inputs*"])


def test_the_builtin_torch_op_is_held_against_an_independent_peer(monkeypatch):
    """torch.softmax compared with torch.softmax could not fail: the built-in target is held
    against the composite exp(x - max) / sum; a user's target against torch's op."""
    kind = registry.get_kind("softmax")
    builtin = next(t for t in kind.default_targets() if t.name == "torch.softmax")
    assert "composite" in kind.peer_for(builtin)[1]
    assert kind.peer_for(Target("mine", lambda x: x, "softmax"))[1] == "torch's op"
    regime = kind.regimes["scale20"]
    case = Case(kind, builtin, CONFIGS["fp32"], NO_VARIANT, "scale20", "cpu")
    m = kind.measure(case, regime.inputs())
    assert not pytest_precision.numerics.budgets.violations(m.results["reference"].oracle, m.results["reference"].peer_budget)
    # were torch's op broken (computing in bf16 inside), its check would say so
    monkeypatch.setattr(kind, "_op", lambda x, dim: torch.softmax(x.bfloat16(), dim).to(x.dtype))
    m = kind.measure(case, regime.inputs())
    assert pytest_precision.numerics.budgets.violations(m.results["reference"].oracle, m.results["reference"].peer_budget)


def test_a_tensor_kind_written_on_the_seam_is_refused_with_the_class_to_use():
    """Kind is the seam alone: a class that writes the tensor hooks on it would leave run, bench_call
    and trace_call undone, so making one says to subclass TensorKind."""
    class Half(Kind):
        name = "half"

        def floating_inputs(self, x):
            return {"x": x}

        def reference(self, x):
            return x

    with pytest.raises(TypeError, match=r"Half writes the tensor kind's hooks \(floating_inputs, reference\) on "
                                        r"pytest_precision.Kind.*subclass pytest_precision.TensorKind"):
        Half()


def test_check_kind_says_what_a_kind_gets_wrong():
    from pytest_precision.kinds.cases import Regime

    class Drifting(type(registry.get_kind("softmax"))):
        """Its regime draws from torch's global generator, not the one it is given: other bits each call."""
        regimes = {"unit": Regime.from_generator("unit", "N(0, 1)", lambda g: torch.randn(4, 8), base_seed=1)}

        def __init__(self):
            super().__init__(log=False)
            self.name = "drifting"

    with pytest.raises(AssertionError, match="kind 'drifting': regime 'unit' gave other inputs on a second call"):
        check_kind(Drifting())
    with pytest.raises(AssertionError, match="kind 'softmax': target 'wrong' fails the oracle with the peer budget"):
        check_kind(registry.get_kind("softmax"), Target("wrong", lambda x: torch.softmax(x * 1.01, -1), "softmax"))


def test_a_regime_draws_from_a_generator_seeded_as_its_own_seed_would_seed_it():
    from pytest_precision.kinds.cases import Regime
    from pytest_precision.numerics.inputs import seeded_normal

    drawn = Regime.from_generator("unit", "N(0, 1)", lambda g: seeded_normal(g, 4, 8), base_seed=7)
    seeded = Regime("unit", "N(0, 1)", lambda seed: seeded_normal(torch.Generator().manual_seed(seed), 4, 8), base_seed=7)
    assert torch.equal(drawn.inputs(), seeded.inputs())


def test_run_state_belongs_to_one_session():
    """A Triton kernel that cannot launch is said once per session: the first case fails, the later
    ones point to it; a new session (a new RunState) says it again."""
    from pytest_precision.kinds.session import RunState

    state = RunState()
    assert state.first_launch_failure("k", "softmax[k-fp32-unit]") is None
    assert state.first_launch_failure("k", "softmax[k-fp16-unit]") == "softmax[k-fp32-unit]"
    assert RunState().first_launch_failure("k", "softmax[k-fp16-unit]") is None
    from pytest_precision.kinds import Memo

    x = Memo("x")
    assert state.memo(x) is state.memo(x) and RunState().memo(x) == {}
    assert state.memo(Memo("x")) is not state.memo(x)  # two declarations, two memos
    with pytest.raises(TypeError, match="RunState.memo takes a pytest_precision.kinds.Memo"):
        state.memo("x")


def test_a_tensor_kind_overrides_hooks_not_the_template():
    with pytest.raises(TypeError, match="Stashing overrides TensorKind's template method measure: override its hooks"):
        class Stashing(pytest_precision.TensorKind):
            def measure(self, case, inputs, grad_seed=0):
                return super().measure(case, inputs, grad_seed)
    with pytest.raises(TypeError, match="Partial leaves TensorKind's required hook reference unwritten"):
        class Partial(pytest_precision.TensorKind):  # the core's required hooks are abstract
            name, suite = "partial", "softmax"

            def floating_inputs(self, inputs):
                return {"x": inputs}

            def invoke(self, fn, values, inputs, device):
                return fn(values["x"])

            def expected_shape(self, values, inputs):
                return values["x"].shape

            def peer(self, x):
                return x
        Partial()
