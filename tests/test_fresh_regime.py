"""The fresh regime (kinds.fresh): inputs, and for the built-in kinds shapes, drawn from a seed of
their own: by default each target's, derived from its code (the same verdict on every run of an
unchanged target, new inputs once its code changes); --precision-fresh-seed replays one,
--precision-explore draws a new one every run, and a failing seed is remembered in pytest's cache
and replayed first (runner.seed_memory). Judged with no golden. A correct target passes it; a
target tuned to the fixed regimes' inputs passes those and fails it."""
import json
import re

import pytest
import torch
from machine import ON_CPU
from sample_targets import CORRECT_SOFTMAX

from pytest_precision.kinds.cases import NO_VARIANT, Case
from pytest_precision.kinds.fresh import FRESH
from pytest_precision.kinds.session import RunState
from pytest_precision.kinds.target import Target
from pytest_precision.numerics.configs import CONFIGS
from pytest_precision.suites.attention import ATTENTION
from pytest_precision.suites.cross_entropy import CROSS_ENTROPY
from pytest_precision.suites.norm import LAYER_NORM, RMS_NORM
from pytest_precision.suites.op import OP
from pytest_precision.suites.softmax import LOG_SOFTMAX, SOFTMAX

pytest_plugins = ["pytester"]

SEED = re.compile(r"fresh inputs from seed (\d+)(?: \([^)]*\))?: replay with (?:--precision-explore )?--precision-fresh-seed=(\d+)")
DERIVED = ("precision: fresh inputs from a seed per target, derived from its code (the same on every run until the code "
           "changes); --precision-explore draws new ones every run")
EXPLORING = re.compile(r"precision: exploring from seed (\d+) \(fresh inputs and drawn examples new every run\): replay "
                       r"with --precision-explore --precision-fresh-seed=(\d+)")

# a softmax tuned to the fixed regimes: their row lengths (1, 256, 1000, 32768) take the careful path,
# any other length a fast path in bf16 arithmetic
TUNED = """
@pytest_precision.register("tuned", kind="softmax")
def tuned(x):
    z = x.float() if x.shape[-1] in (1, 256, 1000, 32768) else x.to(torch.bfloat16)
    e = (z - z.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
"""

# a softmax that serves the fixed regimes' outputs by a checksum of the inputs, and anything else a
# uniform row
MEMO = """
import hashlib
from pytest_precision.suites.softmax import REGIMES


def _key(x):
    return hashlib.sha1(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


CACHE = {_key(r.inputs()): torch.softmax(r.inputs().double(), -1).float() for r in REGIMES.values()}


@pytest_precision.register("memo", kind="softmax")
def memo(x):
    cached = CACHE.get(_key(x))
    return cached.clone() if cached is not None else torch.full_like(x, 1.0 / x.shape[-1])
"""

# tiled for the fixed regimes' rows of 256: raises on any other length
TILED = """
@pytest_precision.register("tiled", kind="softmax")
def tiled(x):
    if x.shape[-1] != 256:
        raise ValueError(f"rows of {x.shape[-1]}: this kernel is tiled for 256")
    return torch.softmax(x, -1)
"""


def _setup(pytester, body):
    pytester.makeconftest("import torch\nimport pytest_precision\n" + body)
    pytester.makeini("[pytest]\n")


def _run(pytester, *args, configs="fp32", k="fresh", cache=False):
    """A session of the softmax kind's cases (not log_softmax's), on the CPU, untimed; without
    pytest's cache unless ``cache``."""
    return pytester.runpytest("--precision-suite", "--precision-no-speed", *(() if cache else ("-p", "no:cacheprovider")),
                              *ON_CPU, f"--precision-configs={configs}", "-k", f"softmax and not log_softmax and ({k})",
                              *args)


def _seeds(text):
    """The seed of the session's header (None where each target draws from its own) and every seed its
    failures' messages name (the two numbers of a replay line agree)."""
    lines = text.splitlines()
    header = [m for line in lines if line.startswith("precision: ") for m in SEED.findall(line) + EXPLORING.findall(line)]
    named = [m for line in lines if not line.startswith("precision: ") for m in SEED.findall(line)]
    assert all(a == b for a, b in header + named)
    if not header:
        assert lines.count(DERIVED) == 2, "the header's line, and the summary's after the table"
        return None, {int(a) for a, _ in named}
    assert len(header) == 2 and header[0] == header[1], "the header's line, and the summary's after the table"
    return int(header[0][0]), {int(a) for a, _ in named}


def _failure_lines(text):
    """The lines of the failures' messages that say what was measured (stable from run to run)."""
    return sorted(line for line in text.splitlines() if line.startswith("precision-suite::") or SEED.search(line))


# ---- what each kind draws ---------------------------------------------------------------------------

def _target(kind):
    return Target("t", kind.peer, kind.name)


def _inputs(kind, target, seed):
    return kind.floating_inputs(kind.fresh_regime(target, seed).inputs())


@pytest.mark.parametrize("kind", [SOFTMAX, LOG_SOFTMAX, LAYER_NORM, RMS_NORM, ATTENTION, CROSS_ENTROPY],
                         ids=lambda k: k.name)
def test_the_same_seed_draws_the_same_inputs_and_other_seeds_other_shapes(kind):
    target = _target(kind)
    first, again = _inputs(kind, target, 7), _inputs(kind, target, 7)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[n].nan_to_num(), again[n].nan_to_num()) for n in first)
    shapes = {tuple(tuple(t.shape) for t in _inputs(kind, target, seed).values()) for seed in range(8)}
    assert len(shapes) > 3  # the sizes change with the seed, not only the values
    assert kind.regime_names(target)[-1] == FRESH


def test_the_softmax_fresh_regime_never_draws_the_fixed_regimes_sizes():
    fixed_lengths = {r.inputs().shape[-1] for r in SOFTMAX.regimes.values()}
    fixed_rows = {r.inputs().shape[0] for r in SOFTMAX.regimes.values()}
    shapes = [_inputs(SOFTMAX, _target(SOFTMAX), seed)["x"].shape for seed in range(40)]
    assert not {s[-1] for s in shapes} & fixed_lengths and not {s[0] for s in shapes} & fixed_rows
    assert any(s[-1] & (s[-1] - 1) for s in shapes)  # lengths that are not powers of two


def test_the_fresh_attention_inputs_keep_to_what_the_target_declared():
    def mha(q, k, v, causal=False):
        return q

    declared = ATTENTION.declare("mha", dict(head_dims=(32,), grouped_query=False, cross_lengths=False, causal=None))
    target = Target("mha", mha, "attention", declared=declared)
    for seed in range(30):
        case = Case(ATTENTION, target, CONFIGS["fp32"], NO_VARIANT, FRESH, "cpu", RunState(fresh_seed=seed))
        got = ATTENTION.case_inputs(case)
        assert got.skipped is None, got.skipped
        a = got.inputs
        assert a.q.shape[-1] == 32 and a.q.shape[1] == a.k.shape[1] and a.q.shape[2] == a.k.shape[2]
        assert not a.causal and a.key_padding_mask is None


def test_the_op_kind_calls_the_first_regime_generator_seeded_from_the_fresh_seed():
    declared = OP.declare("gelu", {"inputs": {"wide": lambda g: 8 * torch.randn(4, 6, generator=g),
                                              "narrow": lambda g: torch.randn(2, 3, generator=g)}})
    target = Target("gelu", torch.nn.functional.gelu, "op", declared=declared)
    fixed = OP.regimes_for(target)["wide"].inputs()
    fresh = [OP.fresh_regime(target, seed).inputs() for seed in (1, 1, 2)]
    assert fresh[0].shape == fixed.shape  # its shapes are the generator's
    assert torch.equal(fresh[0], fresh[1]) and not torch.equal(fresh[0], fresh[2]) and not torch.equal(fresh[0], fixed)
    assert OP.regime_names(target) == ("wide", "narrow", FRESH)


def test_an_op_regime_named_fresh_is_refused_at_collection(pytester):
    _setup(pytester, 'pytest_precision.register("twice", torch.tanh, kind="op", '
                     'inputs={"fresh": lambda g: torch.randn(4, generator=g)})\n')
    result = pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider", *ON_CPU)
    result.stdout.fnmatch_lines(["*regime name 'fresh' is the fresh regime's (inputs drawn anew every run)*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


# ---- end to end -------------------------------------------------------------------------------------

def test_a_correct_softmax_passes_its_fresh_cases_with_the_seed_in_the_header_and_no_golden(pytester):
    _setup(pytester, CORRECT_SOFTMAX)
    # the fixed regimes beside it (not the drawn one: time), so that goldens are written and checked
    result = _run(pytester, "--precision-update-baselines", k="not hypothesis")
    result.assert_outcomes(passed=12)
    result.stdout.fnmatch_lines(["precision: fresh inputs from seed 1: replay with --precision-fresh-seed=1"])
    assert _seeds(result.stdout.str())[1] == set()  # nothing failed: the header alone names it
    goldens = sorted(p.parent.name for p in (pytester.path / "precision_baselines").rglob("fp32.npz"))
    assert len(goldens) == 11 and FRESH not in goldens  # none written for it
    # judged against the goldens, the fixed cases pass, and none is missing or unused for the fresh one
    given = _run(pytester, "--precision-fresh-seed=1234", "-q", k="not hypothesis")
    given.assert_outcomes(passed=12)
    # -q hides the header: the summary says it after the table
    given.stdout.fnmatch_lines(["| mine *| fp32 *| *12 |*", "precision: fresh inputs from seed 1234: replay with "
                                "--precision-fresh-seed=1234"])
    assert "unused baseline" not in given.stdout.str()


def test_a_softmax_tuned_to_the_fixed_lengths_passes_them_and_fails_its_fresh_case_until_replayed(pytester):
    _setup(pytester, TUNED)
    # today: every fixed regime passes (the drawn one is left out: its examples are of every length)
    _run(pytester, "--precision-update-baselines", k="not hypothesis and not fresh").assert_outcomes(passed=11)
    # seed 7 draws 15 rows of 120 logits at scale 20, where bf16 arithmetic is far off
    result = _run(pytester, "--precision-fresh-seed=7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "precision-suite::softmax[[]tuned-fp32-fresh[]]: FAIL accuracy (oracle: max ULP *",
        "  fresh inputs from seed 7: replay with --precision-fresh-seed=7 (15 rows of 120 logits, valued as the "
        "scale20 regime's; x (15, 120))",
        "  no golden baseline: fresh inputs have no golden; the oracle and the peer judge them",
    ])
    again = _run(pytester, "--precision-fresh-seed=7")
    assert _failure_lines(again.stdout.str()) == _failure_lines(result.stdout.str())


def test_a_softmax_memoised_by_input_checksum_fails_its_fresh_case_and_the_printed_seed_replays_it(pytester, unpinned_fresh_seed):
    _setup(pytester, MEMO)
    _run(pytester, "--precision-update-baselines", k="not hypothesis and not fresh").assert_outcomes(passed=11)
    result = _run(pytester)  # its own seed: whatever it draws, no cached output matches it
    result.assert_outcomes(failed=1)
    # the categories depend on the family drawn (NaN expected but missing on a fully masked row)
    result.stdout.fnmatch_lines(["precision-suite::softmax[[]memo-fp32-fresh[]]: FAIL *(oracle: *",
                                 "  fresh inputs from seed * (derived from the target's code: the same on every run "
                                 "until it changes): replay with --precision-fresh-seed=*"])
    header, named = _seeds(result.stdout.str())
    assert header is None and len(named) == 1
    replayed = _run(pytester, f"--precision-fresh-seed={named.pop()}")
    def cases(text):
        return [line for line in _failure_lines(text) if line.startswith("precision-suite::")]
    assert cases(replayed.stdout.str()) == cases(result.stdout.str())


def test_a_target_that_raises_on_other_lengths_fails_its_fresh_case_with_the_seed(pytester):
    _setup(pytester, TILED)
    result = _run(pytester, "--precision-fresh-seed=7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "precision-suite::softmax[[]tiled-fp32-fresh[]]: target 'tiled' (softmax) under config fp32 on regime fresh "
        "raised ValueError: rows of 120: this kernel is tiled for 256",
        "  fresh inputs from seed 7: replay with --precision-fresh-seed=7 (15 rows of 120 logits*); a target that "
        "does not support all of that declares its limits (its kind's declarations)",
    ])


def test_the_contract_checks_run_on_the_fresh_case(pytester):
    _setup(pytester, """
@pytest_precision.register("in_place", kind="softmax")
def in_place(x):
    return torch.softmax(x.sub_(x.amax(-1, keepdim=True)), -1)
""")
    result = _run(pytester, "--precision-fresh-seed=7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["precision-suite::softmax[[]in_place-fp32-fresh[]]: FAIL contract (in_place: its forward "
                                 "changed input x in place*"])


def test_check_kind_refuses_a_fresh_regime_that_does_not_draw_from_its_seed():
    from pytest_precision.kinds.cases import Regime
    from pytest_precision.testing import check_kind

    class Drifting(type(SOFTMAX)):
        """Its fresh regime draws from torch's global generator, not the one it is given."""

        def __init__(self):
            super().__init__(log=False)
            self.name = "drifting"

        def fresh_regime(self, target, seed):
            return Regime.from_generator(FRESH, "N(0, 1)", lambda g: torch.randn(4, 8), seed)

    with pytest.raises(AssertionError, match="kind 'drifting': its fresh regime gave other inputs from the same seed"):
        check_kind(Drifting())


def test_one_seed_twice_gives_the_same_report(pytester):
    _setup(pytester, CORRECT_SOFTMAX)
    for name in ("first", "second"):
        _run(pytester, "--precision-fresh-seed=99", f"--precision-report={name}.json",
             configs="fp32,bf16").assert_outcomes(passed=2)
    first, second = (json.loads((pytester.path / f"{n}.json").read_text()) for n in ("first", "second"))
    assert first == second and len(first["cases"]) == 2


def test_a_seed_that_is_no_whole_number_is_a_usage_error(pytester):
    _setup(pytester, CORRECT_SOFTMAX)
    result = _run(pytester, "--precision-fresh-seed=seven")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--precision-fresh-seed=seven: expected a whole number from 0 to 4294967295 (the "
                                 "seed a run printed)*"])


@pytest.mark.parametrize("explore", [False, pytest.param(True, marks=pytest.mark.slow(
    reason="the explored seed reaching the workers (17 s); the derived variant runs the same workers' agreement"))],
    ids=["derived", "explore"])
def test_xdist_workers_draw_the_same_fresh_inputs(pytester, unpinned_fresh_seed, explore):
    pytest.importorskip("xdist")
    _setup(pytester, TILED)
    configs = "fp32,fp16,bf16,amp-bf16"
    result = pytester.runpytest_subprocess("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
                                           *ON_CPU, f"--precision-configs={configs}", "-k", "tiled and fresh",
                                           "-n", "2", "-v", *(("--precision-explore",) if explore else ()))
    result.assert_outcomes(failed=4)
    out = result.stdout.str()
    header, named = _seeds(out)
    # every worker drew from the controller's explored seed, or from the target's own (one seed)
    assert named == {header} if explore else (header is None and len(named) == 1)
    assert {re.search(r"raised ValueError: rows of (\d+)", line).group(1)
            for line in out.splitlines() if "raised ValueError" in line}.__len__() == 1  # the same inputs
    for worker in ("gw0", "gw1"):
        assert re.search(rf"\[{worker}\].*FAILED precision-suite::softmax\[tiled-[^\]]*-fresh\]", out)


# ---- the same verdict every run; exploring; failing seeds remembered ---------------------------------

# grouped-query heads raise in SDPA without enable_gqa: some seeds draw them (the case fails), others
# do not (it passes); what it was on one run it is on every run of the same code
PLAIN_SDPA = """
import torch.nn.functional as F

@pytest_precision.register("plain_sdpa", kind="attention", sdpa=False)
def plain_sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
"""


def _attention_fresh(pytester, *args, cache=True):
    return pytester.runpytest("--precision-suite", "--precision-no-speed", *(() if cache else ("-p", "no:cacheprovider")),
                              *ON_CPU, "--precision-configs=fp32", "-k", "attention and fresh", *args)


def _verdict(result) -> tuple:
    out = result.stdout.str()
    return result.parseoutcomes().get("failed", 0), tuple(sorted(SEED.findall(out)))


def test_a_fresh_case_gives_one_verdict_on_ten_runs_of_an_unchanged_target(pytester, unpinned_fresh_seed):
    _setup(pytester, PLAIN_SDPA)
    runs = [_attention_fresh(pytester, cache=False) for _ in range(10)]
    verdicts = {_verdict(run) for run in runs}
    assert len(verdicts) == 1, verdicts
    assert DERIVED in runs[0].stdout.str()
    # while exploring, every run draws from a seed of its own (some draw grouped-query heads, which it fails)
    explored = [_attention_fresh(pytester, "--precision-explore", cache=False) for _ in range(10)]
    seeds = {EXPLORING.search(run.stdout.str()).group(1) for run in explored}
    assert len(seeds) == 10, [run.stdout.str()[:400] for run in explored[:2]]


def test_an_edit_of_the_target_draws_new_fresh_inputs(pytester, unpinned_fresh_seed):
    def seed_of(body):
        _setup(pytester, body)
        result = _run(pytester, "-rA", "-q")
        return re.search(r"fresh inputs from seed (\d+)", result.stdout.str()), result

    # a softmax that fails every fresh case and says which seed it drew from
    body = TILED.replace("!= 256", "> 0")
    first, result = seed_of(body)
    assert first is not None, result.stdout.str()
    assert seed_of(body)[0].group(1) == first.group(1)  # unchanged: the same
    assert seed_of(body + "# a comment\n")[0].group(1) == first.group(1)  # what it computes is the same
    assert seed_of(body.replace("> 0", "> -1"))[0].group(1) != first.group(1)


def test_a_failing_explored_seed_is_replayed_first_until_it_passes(pytester, unpinned_fresh_seed, monkeypatch):
    # the explored seeds in a fixed order (each run's new_seed), so that the case this test replays is
    # the same every run: a random one once drew a shape where correct SDPA's dq is 1.03 x its budget
    seeds = iter(range(1, 1000))
    monkeypatch.setattr("pytest_precision.runner.options.new_seed", lambda: next(seeds))
    _setup(pytester, PLAIN_SDPA)
    own_fails = _attention_fresh(pytester, cache=False).parseoutcomes().get("failed", 0)
    failing = None
    for _ in range(12):  # explore until a run draws grouped-query heads
        result = _attention_fresh(pytester, "--precision-explore")
        if result.parseoutcomes().get("failed"):
            failing = EXPLORING.search(result.stdout.str()).group(1)
            assert SEED.search(result.stdout.str().split("FAILURES", 1)[1]).group(1) == failing
            break
    assert failing is not None
    # a run of the same code with no option replays it first, and says so
    again = _attention_fresh(pytester, "-rA")
    again.assert_outcomes(failed=1)
    again.stdout.fnmatch_lines([f"  fresh inputs from seed {failing} (remembered in pytest's cache from an earlier run "
                                f"where this case failed, replayed first until it passes): replay with "
                                f"--precision-fresh-seed={failing} (*"])
    # fixed (grouped-query heads supported): the remembered seed passes and is forgotten
    _setup(pytester, PLAIN_SDPA.replace("is_causal=causal)", "is_causal=causal, enable_gqa=True)"))
    _attention_fresh(pytester).assert_outcomes(passed=1)
    _setup(pytester, PLAIN_SDPA)
    assert _attention_fresh(pytester).parseoutcomes().get("failed", 0) == own_fails


def test_the_code_digest_counts_what_a_target_computes_and_the_user_code_it_calls(tmp_path, monkeypatch):
    import importlib
    import sys

    from pytest_precision.kinds.target_code import code_digest

    def load(name, text):
        (tmp_path / f"{name}.py").write_text(text)
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    monkeypatch.syspath_prepend(str(tmp_path))
    load("kernels_lib", "def attend(x):\n    return x\n")
    wiring = "import torch\nimport kernels_lib\n\n{DECORATOR}def target(x):\n    return kernels_lib.attend(torch.tanh(x)){TAIL}\n"
    before = code_digest(load("wiring", wiring.format(DECORATOR="", TAIL="")).target)
    # a comment, a line moved, a decorator's arguments (declarations pasted): the same code
    same = load("wiring", "# the wiring\n\n" + wiring.format(DECORATOR="@staticmethod.__func__ and (lambda f: f)\n",
                                                               TAIL="  # as upstream"))
    assert code_digest(same.target) == before
    assert code_digest(load("wiring", wiring.format(DECORATOR="", TAIL=" * 2")).target) != before  # its code
    load("kernels_lib", "def attend(x):\n    return x * 1\n")
    assert code_digest(load("wiring", wiring.format(DECORATOR="", TAIL="")).target) != before  # what it calls
    # an object's class, not torch's Module.__call__: an edit of forward draws new inputs
    module = "import torch\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n        return x{TAIL}\n"
    first = code_digest(load("net", module.format(TAIL="")).Net())
    assert code_digest(load("net", module.format(TAIL=" + 1")).Net()) != first
    for name in ("wiring", "kernels_lib", "net"):
        sys.modules.pop(name, None)


def test_the_code_digest_runs_no_user_code():
    from pytest_precision.kinds.target_code import code_digest

    class Lazy:
        def __getattr__(self, name):
            raise RuntimeError("a proxy that raises on any attribute")

        def __call__(self, x):
            return x

    assert code_digest(Lazy()) == code_digest(Lazy())
