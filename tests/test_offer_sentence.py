"""One wording offers the update command (baselines.commands.offer): a missing golden, a changed
result, an unreadable golden and a machine with no budget of its own all end with it, and no other
lead-in to the command exists in the package or the suites."""
import ast
import pathlib

import pytest

from pytest_precision.baselines.commands import OFFER, UPDATE_OPTION

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a string ending in "with:" or "with: " is how a sentence hands over a command
LEAD_IN_ENDINGS = ("with:", "with: ")


def _offers(tree: ast.AST):
    """(line, text) of every place that hands over the update command or option in words of its own:
    a literal ending in "with:" / "with" before a value (an f-string's placeholder, a "+"), or a
    string built around ``UPDATE_OPTION``, ``update_command`` or a ``command``."""
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    commandish = ("UPDATE_OPTION", "update_command", "command", "cmd")
    for node in ast.walk(tree):
        if id(node) in bare:
            continue
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                if not isinstance(part, ast.FormattedValue):
                    continue
                value = ast.unparse(part.value)
                if any(w in value for w in commandish) and not value.startswith(("offer(", "offer_rerun(")):
                    yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            text = ast.unparse(node)
            if any(w in text for w in commandish) and ("with" in text or "UPDATE_OPTION" in text):
                yield node.lineno, text
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rstrip().endswith("with:"):
            yield node.lineno, node.value


def _strings(tree: ast.AST):
    """The string literals of the code (docstrings and other bare strings left out: they say, not offer)."""
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    for node in ast.walk(tree):
        if id(node) in bare:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):  # an f-string's literal parts, each before a placeholder
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield node.lineno, part.value


def test_no_other_wording_offers_a_command():
    found = []
    for path in sorted([*ROOT.joinpath("pytest_precision").rglob("*.py"), *ROOT.joinpath("suites").rglob("*.py")]):
        if path.name == "commands.py" and path.parent.name == "baselines":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, text in _offers(tree):
            found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
        for line, text in _strings(tree):
            if UPDATE_OPTION in text and "Option(" not in text:
                found.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    # the option's own table entry and the benchmarks that run it are not offers
    found = [f for f in found if not f.startswith(("pytest_precision/runner/option_table.py",
                                                   "pytest_precision/benchmarks/"))]
    assert not found, "a command offered in another wording than baselines.commands.offer:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", ['"write it with: " + cmd', 'f"re-accept with: {cmd}"',
                                     'f"record with {UPDATE_OPTION}"', '"rerun with " + UPDATE_OPTION',
                                     'f"write it with {command}"', 'f"accept: {self.update_command}"'])
def test_the_scan_finds_a_planted_wording(planted):
    tree = ast.parse(f"cmd = command = 'pytest'\nmessage = {planted}\n")
    assert list(_offers(tree)), planted


def test_the_scan_passes_the_one_sentence_and_other_withs():
    tree = ast.parse('s = offer(command)\nt = f"replay with {REPLAY_OPTION}={seed}"\nu = f"{n} with {m}"\n')
    assert list(_offers(tree)) == []


def test_each_offer_reads_the_same(pytester):
    """A missing golden and a changed result, in a user's test, both end with the one sentence."""
    pytester.makepyfile(test_offer="""
        import torch

        def test_op(golden):
            golden.check(torch.linspace(0, 1, 8) * SCALE, torch.linspace(0, 1, 8))
        SCALE = 1.0
        """)
    missing = pytester.runpytest("-p", "no:cacheprovider")
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines([f"*{OFFER}pytest test_offer.py::test_op {UPDATE_OPTION}*"])
    pytester.runpytest("-p", "no:cacheprovider", UPDATE_OPTION).assert_outcomes(passed=1)
    path = pytester.path / "test_offer.py"
    path.write_text(path.read_text().replace("SCALE = 1.0", "SCALE = 1.001"))
    changed = pytester.runpytest("-p", "no:cacheprovider")
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines([f"*{OFFER}pytest test_offer.py::test_op {UPDATE_OPTION}*"])
