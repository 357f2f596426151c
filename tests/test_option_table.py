"""The options and ini keys are declared once (runner/option_table.py): pytest registers exactly
those, and the README's reference table documents exactly those."""
import re
from pathlib import Path


from pytest_precision.runner import option_table

README = Path(__file__).resolve().parents[1] / "README.md"
# a table row whose first cell is one option or ini key in backticks; an option may show its value
# as --help does (`--precision-configs=ID,ID`)
ROW = re.compile(r"^\|\s*`(--precision[-a-z]*|precision_[a-z_]+)(?:=[^`]*)?`\s*\|", re.MULTILINE)

pytest_plugins = ["pytester"]


def documented_names(text: str) -> set[str]:
    return set(ROW.findall(text))


def test_the_row_pattern_reads_options_with_or_without_their_value_and_ini_keys():
    text = ("| `--precision-suite` | x |\n| `--precision-configs=ID,ID` | y |\n| `precision_timeout` | z |\n"
            "| `--precision-device=cpu\\|cuda` | w |\nsee `--precision-trace` in a sentence\n| option | meaning |\n")
    assert documented_names(text) == {"--precision-suite", "--precision-configs", "precision_timeout",
                                      "--precision-device"}


def test_the_readme_documents_every_option_and_ini_key_and_no_other():
    documented = documented_names(README.read_text(encoding="utf-8"))
    assert sorted(option_table.NAMES - documented) == [], "declared but not in the README's options table"
    assert sorted(documented - option_table.NAMES) == [], "in the README's options table but not declared"


def test_pytest_registers_exactly_the_declared_options_and_ini_keys(pytester, unpinned_fresh_seed):
    config = pytester.parseconfig()
    registered = {name for o in config._parser._groups if o.name == option_table.GROUP[0]
                  for opt in o.options for name in opt.names()}
    assert registered == {o.name for o in option_table.OPTIONS}
    assert {k for k in config._parser._inidict if k.startswith("precision")} == {k.name for k in option_table.INI_KEYS}
    for key in option_table.INI_KEYS:
        assert config.getini(key.name) == (list(key.default) if isinstance(key.default, tuple) else key.default)
    for o in option_table.OPTIONS:
        assert o.value(config) == (False if o.flag else None)


def test_option_names_spelled_below_the_runner_are_declared_options():
    """The baselines layer spells the update command, and the summary its advice, below the runner
    that declares the options (the layers keep them from importing it): each name they spell is one
    the table declares, so a renamed option cannot leave a command that pytest refuses."""
    root = Path(__file__).resolve().parents[1] / "pytest_precision"
    declared = {o.name for o in option_table.OPTIONS}
    for module in ("baselines/commands.py", "reporting/summary.py", "reporting/report.py", "baselines/lifecycle.py",
                   "baselines/tensors.py", "training/baseline.py", "kinds/fresh.py"):
        spelled = set(re.findall(r"--precision-[a-z-]+[a-z]", (root / module).read_text(encoding="utf-8")))
        assert spelled <= declared, f"{module}: {sorted(spelled - declared)} not declared"
