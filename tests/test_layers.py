"""The package's layers, read from the source: each layer imports only the layers below it, the
core never imports the suites or the kernels, and no module imports itself back through others
(deferred, function-level imports included: they hide a cycle, they do not remove it)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source directory -> the package it installs as
SOURCES = {"pytest_precision": "pytest_precision", "suites": "pytest_precision.suites",
           "kernels": "pytest_precision.kernels"}

# layer -> the layers its modules may import (besides their own)
LAYERS = {
    "platform": set(),
    "numerics": {"platform"},
    "baselines": {"platform", "numerics"},
    "explain": {"platform", "numerics"},
    "speed": {"platform", "numerics", "explain"},
    "training": {"platform", "numerics", "baselines", "speed"},
    "kinds": {"platform", "numerics", "baselines", "explain", "speed"},
    "reporting": {"platform", "numerics", "baselines", "explain", "speed", "kinds"},
    "runner": {"platform", "numerics", "baselines", "explain", "speed", "kinds", "reporting"},
    # the public modules: the package's __init__, the plugin (which also installs the kernels'
    # one-pass statistics on CUDA), the command line, the property helpers, thin re-exports
    "api": {"platform", "numerics", "baselines", "explain", "speed", "training", "kinds", "reporting", "runner", "kernels"},
    # benchmarks run the harness as a user would, from outside
    "benchmarks": {"platform", "numerics", "baselines", "explain", "speed", "training", "kinds", "reporting", "runner",
                   "api", "suites", "kernels"},
    "suites": {"platform", "numerics", "baselines", "explain", "speed", "training", "kinds", "kernels", "api"},
    "kernels": {"platform", "numerics", "kinds"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for src, package in SOURCES.items():
        for path in (ROOT / src).rglob("*.py"):
            rel = path.relative_to(ROOT / src).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def layer(module: str) -> str:
    if module == "pytest_precision.kinds.training":
        return "api"  # a thin re-export of the training engine for kinds built on it
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("suites", "kernels", *LAYERS):
        return parts[1]
    if module == "pytest_precision.strategies":
        return "numerics"  # Hypothesis strategies for inputs: numerics only
    return "api"


def _imports(module: str, path: Path) -> set[str]:
    """Every module of ours that ``module`` imports, at any depth of its code."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # not a parent package
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_each_layer_imports_only_the_layers_below_it():
    bad = [f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in GRAPH.items() for d in deps
           if layer(d) != layer(m) and layer(d) not in LAYERS[layer(m)]]
    assert bad == []


def test_the_core_never_imports_suites_or_kernels():
    core = [m for m in GRAPH if layer(m) not in ("suites", "kernels", "api")]
    bad = [f"{m} imports {d}" for m in core for d in GRAPH[m] if layer(d) in ("suites", "kernels")]
    assert bad == []
    assert [d for d in GRAPH["pytest_precision.kinds.registry"] if layer(d) == "suites"] == []


def test_no_import_cycles():
    """Tarjan's strongly connected components over the module graph: none larger than one."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_graph_is_read():
    """The test above cannot pass by reading nothing."""
    assert len(MODULES) > 40
    assert "pytest_precision.numerics.formats" in GRAPH["pytest_precision.numerics.metrics"]
    assert "pytest_precision.kinds" in GRAPH["pytest_precision.suites.softmax"]
    assert layer("pytest_precision.kernels.runtime") == "kernels" and layer("pytest_precision.plugin") == "api"


def test_the_readme_layout_table_lists_each_layers_modules():
    """The README's Layout table names every module of each layer, and no module that is not there."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z_]+)/` \| ([^|]+) \|", readme, flags=re.MULTILINE))
    assert set(rows) == set(LAYERS) - {"api", "suites", "kernels", "benchmarks"}
    for name, cell in rows.items():
        listed = set(re.findall(r"`([a-z_0-9]+\.py)`", cell))
        present = {p.name for p in (ROOT / "pytest_precision" / name).glob("*.py") if p.name != "__init__.py"}
        assert listed == present, f"README layout, {name}/: missing {sorted(present - listed)}, stale {sorted(listed - present)}"


def test_no_module_is_over_450_lines():
    """A module a newcomer reads whole: the package, the suites and the kernels keep each under 450 lines
    (one idea per module; a kind's inputs and floors live beside it, as ``op_inputs`` and ``attention_floors``)."""
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}, f"modules over 450 lines: {long}"
