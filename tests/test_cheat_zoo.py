"""The cheat zoo: targets whose values looked right to the judges of generated kernels (KernelBench,
robust-kbench, the GPU MODE harness) and passed this harness before it checked the callable's
contract (kinds.tensor.contract). Each cheat fails now with one line saying what it did, and its good twin,
the same computation without the cheat, passes in the same session.

Every cheat below passed its session on the harness before the contract checks (9899ff8); the
sessions are fp32 on one or two regimes, as the re-calls run on the fp32 cases. The last, a
low-precision path on lengths no fixed regime has, passes every fixed and drawn regime still, and
fails the fresh regime on the seeds whose lengths take it."""
import pytest

from sample_targets import SOFTMAX_FN

pytest_plugins = ["pytester"]

HEADER = """
import os
import torch
import pytest_precision

""" + SOFTMAX_FN

# name -> (conftest body, the session's -k, the cheat's failure lines (fnmatch), the good twin's name)
ZOO = {
    # an output memoised by shape: the kernel's result for the first inputs of a shape, handed back for
    # every later call with that shape (a benchmark loop calls it on the same inputs: it looks fast)
    "memoised by shape": ("""
_memo = {}


@pytest_precision.register("memo_by_shape", kind="softmax")
def memo_by_shape(x):
    key = (x.shape, x.dtype)
    if key not in _memo:
        _memo[key] = softmax(x)
    return _memo[key]


pytest_precision.register("computed", softmax, kind="softmax")
""", "unit", [
        "*softmax[[]memo_by_shape-fp32-unit[]]: FAIL contract (memo_by_shape: its second call returned the memory of "
        "its first call's output, which the caller still held (an output cached by shape or pointer, a buffer kept "
        "across calls): return a fresh tensor from every call)"], "computed"),

    # a caching allocator's model: the block of its previous output is handed out again, and the launch
    # after the first covers only the first row; the rows below it still hold the first call's values
    "previous output buffer, first row refilled": ("""
_blocks = {}


@pytest_precision.register("kept_block", kind="softmax")
def kept_block(x):
    block = _blocks.get((x.shape, x.dtype))
    if block is None:
        block = _blocks[x.shape, x.dtype] = torch.empty_like(x)
        block.copy_(softmax(x))
    else:
        block[:1] = softmax(x[:1])
    return block.view_as(block)  # another tensor object, the same memory


@pytest_precision.register("new_block", kind="softmax")
def new_block(x):
    block = torch.empty_like(x)
    block.copy_(softmax(x))
    return block
""", "unit", [
        "*softmax[[]kept_block-fp32-unit[]]: FAIL contract (kept_block: its second call returned the memory of its "
        "first call's output, which the caller still held*"], "new_block"),

    # only the first row computed into torch.empty, whose other rows happened to hold the right values:
    # a shape's first call (autotuning) ran the whole kernel into a workspace it freed, and the caching
    # allocator (modelled: a pool of freed blocks by shape) handed that block to the output; later
    # launches cover the first row only, into whatever torch.empty gives
    "torch.empty rows holding the right values": ("""
_freed = {}  # the caching allocator's model: freed blocks by shape, handed out again before new memory
_tuned = set()


def empty_like(x):
    block = _freed.pop((x.shape, x.dtype), None)
    return torch.empty_like(x) if block is None else block


@pytest_precision.register("first_row_only", kind="softmax")
def first_row_only(x):
    if x.shape not in _tuned:
        _tuned.add(x.shape)
        workspace = empty_like(x)
        workspace.copy_(softmax(x))  # every candidate config runs on the whole batch
        _freed[x.shape, x.dtype] = workspace
    out = empty_like(x)
    out[:1] = softmax(x[:1])
    return out


@pytest_precision.register("every_row", kind="softmax")
def every_row(x):
    out = empty_like(x)
    out[:] = softmax(x)
    return out
""", "unit or len32768", [
        "*softmax[[]first_row_only-fp32-unit[]]: FAIL nondeterministic*(first_row_only: a second call on fresh "
        "copies of the same inputs gave other bits: output: 3840 of 4096 elements differ, max inf ULP (NaN on the "
        "second call where the first had values: it reads memory it never wrote, such as an output from "
        "torch.empty left partly unfilled)*",
        "*softmax[[]first_row_only-fp32-len32768[]]: FAIL nondeterministic*output: 32768 of 65536 elements "
        "differ*(NaN on the second call where the first had values: it reads memory it never wrote*"], "every_row"),

    # only the first rows computed: a launch grid sized for the 16 rows it was tuned on, the rows past
    # them left as torch.empty gave them; every fixed regime has 16 rows or fewer
    "grid sized for the tuned batch": ("""
@pytest_precision.register("grid_of_16", kind="softmax")
def grid_of_16(x):
    out = torch.empty_like(x)
    n = min(x.shape[0], 16)
    out[:n] = softmax(x[:n])
    return out


@pytest_precision.register("grid_of_rows", kind="softmax")
def grid_of_rows(x):
    out = torch.empty_like(x)
    out[:x.shape[0]] = softmax(x)
    return out
""", "unit", [
        "*softmax[[]grid_of_16-fp32-unit[]]: FAIL batch_variant (grid_of_16: NaN in rows the full batch gave values "
        "for (inside a batch of 32 (the batch twice)): it reads memory it never wrote, such as rows of a torch.empty "
        "output its launch did not cover)"], "grid_of_rows"),

    # the input modified in place: softmax computed into x and x returned
    "computed into its input": ("""
@pytest_precision.register("into_x", kind="softmax")
def into_x(x):
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


pytest_precision.register("out_of_place", softmax, kind="softmax")
""", "unit", [
        "*softmax[[]into_x-fp32-unit[]]: FAIL contract (into_x: its forward changed input x in place (4096 of 4096 "
        "elements, largest change *); declare mutates=('x',) if it does so by design; into_x: its output shares "
        "memory with input x (the input itself, a view or an alias); return a fresh tensor, or declare "
        "aliases=('x',))"], "out_of_place"),

    # an output aliasing an input: a ReLU whose fast path hands back its input when nothing is negative
    "input handed back": ("""
inputs = {"positive": lambda g: torch.rand(16, 64, generator=g), "unit": lambda g: torch.randn(16, 64, generator=g)}


def relu_fast_path(x):
    return x if bool((x >= 0).all()) else x.clamp_min(0)


def relu_copy_path(x):
    return x.clone() if bool((x >= 0).all()) else x.clamp_min(0)


pytest_precision.register("relu_fast_path", relu_fast_path, kind="op", inputs=inputs, reference=torch.relu)
pytest_precision.register("relu_copy_path", relu_copy_path, kind="op", inputs=inputs, reference=torch.relu)
""", "positive", [
        "*op[[]relu_fast_path-fp32-positive[]]: FAIL contract (relu_fast_path: its output shares memory with input "
        "arg0 (the input itself, a view or an alias); return a fresh tensor, or declare aliases=('arg0',))"],
        "relu_copy_path"),

    # nondeterminism from a racy sum (atomics adding in another order on each launch): a call counter
    # flips the summation order; declared deterministic, as a kernel claiming batch-invariant serving
    # would be (undeclared, the second call's spread is reported and not judged)
    "racy sum": ("""
_launches = [0]


def racy(x):
    _launches[0] += 1
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    s = e.sum(-1, keepdim=True) if _launches[0] % 2 else e.flip(-1).cumsum(-1)[..., -1:]
    return (e / s).to(x.dtype)


pytest_precision.register("racy_sum", racy, kind="softmax", deterministic=True)
pytest_precision.register("ordered_sum", softmax, kind="softmax", deterministic=True)
""", "unit", [
        "*softmax[[]racy_sum-fp32-unit[]]: FAIL nondeterministic (racy_sum: a second call on fresh copies of the same "
        "inputs gave other bits: output: * of 4096 elements differ, max * ULP)"], "ordered_sum"),
}


def _session(pytester, body, k, *args):
    pytester.makeconftest(HEADER + body)
    pytester.makeini("[pytest]\n")
    return pytester.runpytest("--precision-suite", "--precision-no-speed", "-p", "no:cacheprovider",
                              "--precision-configs=fp32", "--precision-update-baselines", "-k", k, *args)


@pytest.mark.parametrize("cheat", ZOO)
def test_the_cheat_fails_saying_what_it_did_and_its_good_twin_passes(pytester, cheat):
    body, k, lines, twin = ZOO[cheat]
    result = _session(pytester, body, k, "-rA")
    cases = 2 if " or " in k else 1
    result.assert_outcomes(passed=cases, failed=cases)
    result.stdout.fnmatch_lines(lines)
    result.stdout.fnmatch_lines([f"PASSED *[[]{twin}-fp32-*"])


# a low-precision path taken only on lengths no fixed regime has: a short tail (under 64 of a block
# of 128) after whole blocks has its exp in bfloat16. Every fixed softmax regime is 1, 256, 1000 or
# 32768 long and the drawn one stays at 128 or under: it passes them all, before the contract checks
# and after. The fresh regime's lengths change every run: 22 of its seeds 0 to 99 take the tail path
# (seed 22: 14 rows of 147 logits), so a CI running it daily catches it within days
TAIL = """
@pytest_precision.register("short_tail_bf16", kind="softmax")
def short_tail_bf16(x):
    xf = x.float()
    z = xf - xf.amax(-1, keepdim=True)
    e = z.exp()
    n, tail = x.shape[-1], x.shape[-1] % 128
    if n > 128 and 0 < tail < 64:
        e[..., n - tail:] = z[..., n - tail:].bfloat16().exp().float()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


pytest_precision.register("fp32_tail", softmax, kind="softmax")
"""


def test_a_low_precision_tail_on_lengths_no_fixed_regime_has_is_caught_by_the_fresh_regime(pytester):
    result = _session(pytester, TAIL, "softmax and not log", "-rA", "--precision-fresh-seed=22")
    result.assert_outcomes(passed=2 * 13 - 1, failed=1)
    result.stdout.fnmatch_lines([
        "*softmax[[]short_tail_bf16-fp32-fresh[]]: FAIL accuracy (oracle: max ULP * > budget *",
        "*fresh inputs from seed 22: replay with --precision-fresh-seed=22 (14 rows of 147 logits*",
    ])
