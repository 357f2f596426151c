"""``python -m pytest_precision baselines list | show NAME | diff A B | prune [--dry-run]`` and
``python -m pytest_precision report merge A.json B.json [-o FILE.md]``.

The baseline directory defaults to ``precision_baseline_dir`` of ``[tool.pytest.ini_options]`` in
./pyproject.toml (relative to it), else ``precision_baselines``, as the plugin resolves it.

Exit status: 0 done; 1 ``diff`` found differences; 2 input that cannot be read (a damaged or torn
baseline, named on stderr after everything readable is printed), a missing directory or list,
or a usage error; 3 an internal error (a bug: the traceback is printed).
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from .baselines.reading import MAX_JSON_BYTES, read_bounded
from .baselines.schema import BaselineError
from .baselines.tools import diff_lines, list_lines, remove, show_lines
from .baselines.usage import CACHE_KEY
from .runner.option_table import BASELINE_DIR, REPORT, SUITE

RERUN = f"run pytest {SUITE.name} again"  # what remakes the list of unused baselines


class InputError(Exception):
    """Input the command cannot read (exit status 2)."""


def _ini_options(cwd: Path) -> dict:
    path = cwd / "pyproject.toml"
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: no tomllib; fall back to the default directory
        return {}
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError) as e:  # TOMLDecodeError, UnicodeDecodeError
        raise InputError(f"{path}: cannot read it ({type(e).__name__}: {e})") from e
    options = data.get("tool", {}).get("pytest", {}).get("ini_options", {})
    return options if isinstance(options, dict) else {}


def default_dir(cwd: Path) -> Path:
    return cwd / str(_ini_options(cwd).get(BASELINE_DIR.name) or BASELINE_DIR.default)


def _cache_file(cwd: Path) -> Path:
    """Where pytest's cache provider keeps CACHE_KEY (``<cache_dir>/v/<key>``)."""
    cache_dir = Path(str(_ini_options(cwd).get("cache_dir") or ".pytest_cache"))
    return (cache_dir if cache_dir.is_absolute() else cwd / cache_dir) / "v" / CACHE_KEY


def _prune(args, cwd: Path, out) -> int:
    cache = _cache_file(cwd)
    try:
        saved = json.loads(read_bounded(cache, MAX_JSON_BYTES).decode("utf-8"))
    except BaselineError as e:
        if cache.exists() or cache.is_symlink():
            raise InputError(f"{e} (the list of unused baselines: {RERUN})") from e
        print(f"no list of unused baselines at {cache}: run pytest {SUITE.name} (with the cache provider "
              "on) first", file=sys.stderr)
        return 2
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
        raise InputError(f"{cache}: not the list a run saves ({type(e).__name__}): {RERUN}") from e
    unused = saved.get("unused") if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or not isinstance(saved.get("root"), str) or not (
            unused is None or (isinstance(unused, list) and all(isinstance(n, str) for n in unused))):
        raise InputError(f"{cache}: not the list a run saves (an object with a root and a list of names): "
                         f"{RERUN}")
    root = Path(saved["root"])
    if root.resolve() != args.dir.resolve():
        print(f"the last run checked {root}, not {args.dir}: pass --dir {root} or rerun pytest", file=sys.stderr)
        return 2
    if saved.get("unused") is None:
        print(f"the last run did not check for unused baselines: {saved.get('reason')}", file=sys.stderr)
        return 2
    files = remove(root, saved["unused"], dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for p in files:
        print(f"{verb} {p.relative_to(root.resolve())}", file=out)
    print(f"{verb} {len(files)} file(s) of {len(saved['unused'])} unused baseline(s) under {root}", file=out)
    return 0


def _merge(args, cwd: Path, out) -> int:
    from .reporting.merge import MergeError, load_report, render_merged

    paths = [p if p.is_absolute() else cwd / p for p in args.reports]
    try:
        reports = [(p, load_report(p)) for p in paths]
    except MergeError as e:
        print(e, file=sys.stderr)
        return 2
    text = render_merged(reports)
    if args.output is None:
        print(text, file=out)
    else:
        target = args.output if args.output.is_absolute() else cwd / args.output
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(f"merged {len(reports)} reports into {target}", file=out)
    return 0


def main(argv: list[str] | None = None, cwd: Path | None = None, out=None) -> int:
    try:
        return _main(argv, cwd, out)
    except (InputError, BaselineError) as e:
        print(e, file=sys.stderr)
        return 2
    except OSError as e:  # a link loop, a directory that cannot be listed: the input, not a bug
        print(f"{e.filename or ''}: {e.strerror or e}" if e.filename else str(e), file=sys.stderr)
        return 2
    except Exception:  # never the exit status of "differences found"
        traceback.print_exc()
        print("python -m pytest_precision: internal error (the traceback above); please report it", file=sys.stderr)
        return 3


def _report(errors: list[str]) -> bool:
    for e in errors:
        print(e, file=sys.stderr)
    return bool(errors)


def _main(argv: list[str] | None, cwd: Path | None, out) -> int:
    cwd = Path.cwd() if cwd is None else cwd
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(prog="python -m pytest_precision")
    sub = parser.add_subparsers(dest="command", required=True)
    baselines = sub.add_parser("baselines", help="golden baseline tools")
    actions = baselines.add_subparsers(dest="action", required=True)

    def with_dir(p):
        p.add_argument("--dir", type=Path, default=None,
                       help=f"baseline directory (default: {BASELINE_DIR.name} from ./pyproject.toml, "
                            f"else {BASELINE_DIR.default})")
        return p

    with_dir(actions.add_parser("list", help="one line per baseline"))
    with_dir(actions.add_parser("show", help="the metadata and budgets of one baseline")).add_argument(
        "name", help="<key>/<config>, as list prints it")
    diff = actions.add_parser("diff", help="every budget that moved between two baseline directories")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path)
    prune = with_dir(actions.add_parser("prune", help=f"remove the baselines the last {SUITE.name} run did not use"))
    prune.add_argument("--dry-run", action="store_true", help="list the files, remove nothing")
    report = sub.add_parser("report", help="report tools")
    report_actions = report.add_subparsers(dest="action", required=True)
    merge = report_actions.add_parser("merge", help=f"reports of several machines ({REPORT.name}) in one table")
    merge.add_argument("reports", type=Path, nargs="+", metavar="REPORT.json")
    merge.add_argument("-o", "--output", type=Path, default=None, help="write the Markdown table here, not to stdout")
    args = parser.parse_args(argv)

    if args.command == "report":
        return _merge(args, cwd, out)
    if getattr(args, "dir", None) is None and args.action != "diff":
        args.dir = default_dir(cwd)
    elif args.action != "diff" and not args.dir.is_absolute():
        args.dir = cwd / args.dir
    errors: list[str] = []
    if args.action in ("list", "show") and not args.dir.is_dir():
        what = "no such directory" if not args.dir.exists() else "not a directory"
        print(f"{args.dir}: {what} (the baseline directory: --dir, or the ini's precision_baseline_dir)",
              file=sys.stderr)
        return 2
    if args.action == "list":
        for line in list_lines(args.dir, errors):
            print(line, file=out)
        return 2 if _report(errors) else 0
    if args.action == "show":
        try:
            lines = show_lines(args.dir, args.name, errors)
        except (FileNotFoundError, BaselineError) as e:
            print(e, file=sys.stderr)
            return 2
        print("\n".join(lines), file=out)
        return 2 if _report(errors) else 0
    if args.action == "diff":
        a, b = (p if p.is_absolute() else cwd / p for p in (args.a, args.b))
        for p in (a, b):
            if not p.is_dir():
                print(f"{p}: not a directory", file=sys.stderr)
                return 2
        lines = diff_lines(a, b, errors)
        for line in lines:
            print(line, file=out)
        if _report(errors):
            return 2  # as diff(1): trouble outranks differences
        return 1 if lines else 0  # as diff(1): 1 when they differ
    return _prune(args, cwd, out)


if __name__ == "__main__":
    sys.exit(main())
