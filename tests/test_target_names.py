"""One name, one file: target names are checked when they are registered, names that would share
a baseline file are refused with both names, and every command the suite prints works when
pasted into a shell."""
import re
import subprocess

import pytest

import pytest_precision
from pytest_precision.kinds import registry

pytest_plugins = ["pytester"]


def _softmax(x):
    return x.float().softmax(-1).to(x.dtype)


@pytest.fixture
def clean_registry():
    registry.clear()
    yield
    registry.clear()


@pytest.mark.parametrize("name", ["my soft", "", "..", ".", "x/..", "a,b", "it's", "tab\there", "-k", "a" * 101,
                                  "caf\u00e9", "\u00f6l"])
def test_names_outside_the_character_set_are_refused(clean_registry, name):
    # the rule says ASCII: before, "ö" was refused as not among the "letters"
    with pytest.raises(ValueError, match=r"target name .*ASCII letters \(A-Z, a-z\), digits"):
        pytest_precision.register(name, _softmax, kind="softmax")
    assert registry.registered() == []


def test_names_that_would_share_a_file_are_refused_with_both_names(clean_registry):
    pytest_precision.register("mine", _softmax, kind="softmax")
    with pytest.raises(ValueError, match="'Mine' and 'mine' would share"):
        pytest_precision.register("Mine", lambda x: x, kind="softmax")
    assert [t.name for t in registry.registered()] == ["mine"]


def test_one_callable_under_a_second_kind_is_refused(clean_registry):
    pytest_precision.register("mine", _softmax, kind="softmax")
    with pytest.raises(ValueError, match="'mine' is already registered as a softmax target"):
        pytest_precision.register("mine", _softmax, kind="log_softmax")
    assert [(t.name, t.kind) for t in registry.registered()] == [("mine", "softmax")]
    pytest_precision.register("mine", _softmax, kind="softmax")  # the same registration again is harmless


def test_a_conftest_registering_a_bad_name_is_a_usage_error(pytester):
    pytester.makeconftest("""
import pytest_precision

@pytest_precision.register("my soft", kind="softmax")
def mine(x):
    return x.softmax(-1)
""")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "target name 'my soft'" in result.stdout.str() + result.stderr.str()


def test_an_ini_target_and_a_registered_one_sharing_a_file_are_refused(pytester):
    pytester.makepyfile(mykernels="import torch\ndef softmax(x):\n    return torch.softmax(x, -1)\n")
    pytester.syspathinsert()
    pytester.makeconftest("""
import torch
import pytest_precision

pytest_precision.register("mykernels_softmax", lambda x: torch.softmax(x, -1), kind="softmax")
""")
    pytester.makeini("[pytest]\nprecision_targets =\n    mykernels:softmax softmax\n")
    result = pytester.runpytest("--precision-suite", "--precision-configs=fp32", "-p", "no:cacheprovider",
                                "--collect-only", "-q")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*target names 'mykernels:softmax' and 'mykernels_softmax' would share the "
                                 "baseline files of softmax/mykernels_softmax*"])


def _shell(pytester, command):
    """Run a printed command as a user pastes it: bash parses it (its quoting and escapes), and the
    words it hands ``pytest`` run in-process (a pytest process per command took 5 to 7 s)."""
    assert command.startswith("pytest "), command
    words = subprocess.run(["bash", "-c", "printf '%s\\0' " + command.removeprefix("pytest ")], capture_output=True,
                           text=True, check=True).stdout.split("\0")[:-1]
    return pytester.runpytest(*words, "-p", "no:cacheprovider", "--precision-no-speed")


KIND_WITH_A_PREFIX = '''
import torch
import pytest_precision
from pytest_precision.numerics.inputs import seeded_normal


class SafeSoftmax(pytest_precision.TensorKind):
    """A kind whose name ends with another's: "softmax[t-fp32-unit]" is inside "safe_softmax[t-fp32-unit]"."""
    name = "safe_softmax"
    contract = "fn(x) -> softmax over the last dimension"
    regimes = {"unit": pytest_precision.Regime("unit", "N(0, 1)", lambda s: seeded_normal(torch.Generator().manual_seed(s), 4, 8), 3)}

    def floating_inputs(self, x):
        return {"x": x}

    def invoke(self, fn, values, x, device):
        return fn(values["x"])

    def expected_shape(self, values, x):
        return tuple(values["x"].shape)

    def reference(self, x):
        return torch.softmax(x, -1)

    def peer(self, x):
        return torch.softmax(x, -1)

    def default_targets(self):
        return [pytest_precision.Target("torch.softmax", self.peer, self.name, origin="built-in")]


KIND = SafeSoftmax()
'''


def test_printed_update_commands_select_exactly_their_case(pytester):
    """The -k expression the failure prints is pasted through a shell: it selects that one case,
    not another whose name contains it, and writes that golden only."""
    pytester.makepyfile(safe_kind=KIND_WITH_A_PREFIX)
    pytester.makeconftest('import pytest_precision\npytest_precision.register_kind("safe_kind:KIND")\n')
    result = pytester.runpytest("--precision-suite", "--precision-configs=fp32", "--precision-no-speed",
                                "-p", "no:cacheprovider", "-k", "torch.softmax-fp32-unit")
    result.assert_outcomes(failed=2)  # softmax[torch.softmax-fp32-unit] and safe_softmax[...]: no goldens yet
    # each once (under CI pytest's short summary repeats the whole message)
    commands = list(dict.fromkeys(re.findall(r"accept it with: (pytest .*)$", result.stdout.str(), re.MULTILINE)))
    assert len(commands) == 2, result.stdout.str()
    for command in commands:
        kind = "safe_softmax" if "k 'safe_softmax" in command else "softmax"
        fixed = _shell(pytester, command + " -v")  # -v names the case it ran (one, not two)
        assert fixed.ret == 0, fixed.stdout.str()[-3000:]
        fixed.assert_outcomes(passed=1)
        assert f"precision-suite::{kind}[torch.softmax-fp32-unit] PASSED" in fixed.stdout.str()
    written = sorted(p.relative_to(pytester.path / "precision_baselines").as_posix()
                     for p in (pytester.path / "precision_baselines").rglob("*.npz"))
    assert written == ["safe_softmax/torch.softmax/unit/fp32.npz", "softmax/torch.softmax/unit/fp32.npz"]


def test_printed_commands_of_user_tests_work_with_any_parameter_id(pytester):
    pytester.makepyfile(test_user="""
import pytest
import torch

@pytest.mark.parametrize("label", ["a b", "it's", "x,y"])
def test_softmax(precision_config, golden, label):
    x = torch.linspace(-3, 3, 32).reshape(4, 8) * (1 + len(label))
    inp = precision_config.prepare(x)
    with precision_config:
        out = inp.value.softmax(-1)
    golden.check(out, torch.softmax(inp.exact, -1), inputs=x)
""")
    result = pytester.runpytest("--precision-configs=fp32", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=3)
    # each once (under CI pytest's short summary repeats the whole message)
    commands = list(dict.fromkeys(re.findall(r"accept it with: (pytest .*)$", result.stdout.str(), re.MULTILINE)))
    assert len(commands) == 3
    for command in commands:
        fixed = _shell(pytester, command + " --precision-configs=fp32")
        assert fixed.ret == 0, fixed.stdout.str()[-3000:]
        fixed.assert_outcomes(passed=1)
    pytester.runpytest("--precision-configs=fp32", "-p", "no:cacheprovider").assert_outcomes(passed=3)
