"""The run's block of declarations: one edit that turns correct code green.

A case whose failure is something its target does by design (a convention: the mean of v on a
fully masked row; an input written in place; a feature it does not support, on which it raised)
carries the declaration that says so (``declare`` in its record, or ``declare_any`` where the
inputs had several features, any one of which may be the cause). At the end of the run they are
gathered per target into one line to paste into its registration, with how many failed cases each
explains; the failures they do not explain stay listed as failures.

Per key one value: for input names (``mutates``, ``aliases``) the union of those found; for any
other key the value its fp32 cases found, else the one most cases found (a target has one
convention, the one it keeps in fp32: a fully masked row returning the mean of v in fp32 and NaN in
fp16 is the mean, and the fp16 cases, where the 16-bit arithmetic lost it, are not explained). A case is explained when every declaration it needs is in the block (or one of
its alternatives is).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kinds.declarations import NAME_LISTS, Declaration, spell
from ..kinds.registry import INI_ORIGIN

__all__ = ["TargetDeclarations", "gather", "render", "declaration_lines"]


def _failed(record: dict) -> bool:
    """A failure beyond a missing golden (a first run's), which a declaration may explain."""
    return record.get("passed") is False and bool(set(record.get("categories", [])) - {"baseline"})


@dataclass
class TargetDeclarations:
    """What one target's failed cases found it needs."""

    target: str
    kind: str
    declarations: list[Declaration] = field(default_factory=list)
    explains: dict[str, list[dict]] = field(default_factory=dict)  # key=value -> the records of the cases it explains
    unexplained: list[str] = field(default_factory=list)  # failed cases the block does not explain


def _case(record: dict) -> str:
    return record.get("nodeid", "").removeprefix("precision-suite::") or \
        f"{record['kind']}[{record['target']}-{record['config']}-{record['regime']}]"


def _choose(found: list[tuple[Declaration, dict]]) -> list[Declaration]:
    """One declaration per key (module docstring)."""
    by_key: dict[str, list[tuple[Declaration, dict]]] = {}
    for d, record in found:
        by_key.setdefault(d.key, []).append((d, record))
    chosen = []
    for key, items in by_key.items():
        if key in NAME_LISTS:
            names = dict.fromkeys(n for d, _ in items for n in d.value)
            chosen.append(Declaration(key, tuple(names)))
            continue
        votes: dict[str, list] = {}
        for d, record in items:
            votes.setdefault(d.python(), [d, 0, False])
            votes[d.python()][1] += 1
            votes[d.python()][2] |= str(record.get("config", "")).split("+")[0] == "fp32"
        # what the target does in fp32 is its convention: a 16-bit config doing otherwise lost it there
        best = max(votes.values(), key=lambda v: (v[2], v[1]))
        chosen.append(best[0])
    return chosen


def _covers(chosen: list[Declaration], d: Declaration) -> bool:
    for c in chosen:
        if c.key == d.key and (c.value == d.value or (d.key in NAME_LISTS and set(d.value) <= set(c.value))):
            return True
    return False


def _from_crashes_trusted(records: list[dict]) -> bool:
    """Whether a target's crashes can tell what it lacks: some of its cases ran, and none crashed on
    inputs without a feature it could declare away (a target that raises everywhere is broken, not
    lacking grouped-query heads)."""
    crashed = [r for r in records if "crashed" in r]
    ran = [r for r in records if "crashed" not in r and "skipped" not in r]
    return bool(ran) and all(r.get("declare") or r.get("declare_any") for r in crashed)


def _inferred(record: dict) -> bool:
    """Whether the record's declarations are inferred from a crash on inputs with features (the target
    raised on grouped-query heads), rather than seen (an input written, a float32 output)."""
    return "unsupported" in record.get("categories", []) or bool(record.get("declare_any"))


def gather(records: list[dict], existing: dict[str, dict] | None = None) -> list[TargetDeclarations]:
    """Per target whose failed cases name declarations: the block's declarations, what each explains,
    and the target's failures left unexplained; in the order the targets come. ``existing``: target ->
    what it declared already (input names found add to those). A declaration that would skip a case
    of the target that passes is not offered (a kernel that ignores ``causal=False`` on long rows only is
    no causal-only one); nor one found only from crashes of a target that crashes on featureless inputs
    too, or runs nowhere."""
    by_target: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        by_target.setdefault((r.get("kind", ""), r["target"]), []).append(r)
    out = []
    for (kind, target), rs in by_target.items():
        failed = [r for r in rs if _failed(r)]
        trusted = _from_crashes_trusted(rs)
        needs = [(Declaration.from_plain(p), r) for r in failed for p in r.get("declare", []) if trusted or not _inferred(r)]
        if not needs:
            continue
        # passing: all but a missing golden, as on a first run
        passing = {tuple(map(repr, p)) for r in rs if "passed" in r and not _failed(r) for p in r.get("skipped_by", [])}
        chosen = [d for d in _choose(needs) if (repr(d.key), repr(d.as_plain()[1])) not in passing]
        declared = (existing or {}).get(target, {})
        chosen = sorted((Declaration(d.key, tuple(dict.fromkeys((*declared[d.key], *d.value))))
                         if d.key in NAME_LISTS and isinstance(declared.get(d.key), tuple) else d for d in chosen),
                        key=lambda d: d.key)  # the same line whatever order the cases came in
        if not chosen:
            continue
        block = TargetDeclarations(target, kind, chosen)
        for r in sorted(failed, key=_case):
            need = [Declaration.from_plain(p) for p in r.get("declare", [])]
            any_of = [Declaration.from_plain(p) for p in r.get("declare_any", [])] if trusted else []
            if _inferred(r) and not trusted:
                need = []
            if need and r.get("explained") and all(_covers(chosen, d) for d in need):
                for d in need:
                    block.explains.setdefault(next(c for c in chosen if _covers([c], d)).python(), []).append(r)
            elif any_of and any(_covers(chosen, d) for d in any_of):
                d = next(d for d in any_of if _covers(chosen, d))
                block.explains.setdefault(next(c for c in chosen if _covers([c], d)).python(), []).append(r)
            else:
                block.unexplained.append(_case(r))
        out.append(block)
    return out


def _registration(block: TargetDeclarations, origin: str | None) -> str:
    """The line to paste: the register call's new keywords, or what its ini line adds."""
    if origin == INI_ORIGIN:
        return f"add to its {INI_ORIGIN} line: " + " ".join(d.ini() for d in block.declarations)
    return f"pytest_precision.register({spell(block.target)}, ..., " + \
        ", ".join(d.python() for d in block.declarations) + ")"


def _regimes(cases: list[dict]) -> str:
    return ", ".join(dict.fromkeys(r.get("regime", "?") for r in cases))


def declaration_lines(records: list[dict], origins: dict[str, str] | None = None,
                      wheres: dict[str, str] | None = None, existing: dict[str, dict] | None = None) -> list[str]:
    """The block's lines (none where no failure names a declaration). ``origins``: target name ->
    how it was registered (an ini line gets what to add to it); ``wheres``: target name -> where;
    ``existing``: target name -> what it declared (a key it has already is said to be replaced)."""
    blocks = gather(records, existing)
    if not blocks:
        return []
    explained = len({id(r) for b in blocks for v in b.explains.values() for r in v})
    lines = [f"{len(blocks)} target(s) do by design what {explained} failed case(s) failed on: add to each "
             "registration what is below, and those cases pass (or are skipped, outside what the target supports):"]
    for b in blocks:
        where = (wheres or {}).get(b.target)
        lines.append(f"{b.target} ({b.kind}{', registered at ' + where if where else ''}):")
        lines.append(f"    {_registration(b, (origins or {}).get(b.target))}")
        replaced = [d.key for d in b.declarations if d.key in (existing or {}).get(b.target, {})]
        if replaced:
            lines.append(f"      (in place of its own {', '.join(replaced)}=)")
        for d in b.declarations:
            cases = b.explains.get(d.python(), [])
            lines.append(f"      {d.python()}: explains {len(cases)} failed case(s)"
                         + (f" ({_regimes(cases)})" if cases else ""))
        if b.unexplained:
            shown = ", ".join(b.unexplained[:4]) + (f" and {len(b.unexplained) - 4} more" if len(b.unexplained) > 4 else "")
            lines.append(f"      not explained, failures as listed above: {len(b.unexplained)} case(s): {shown}")
    return lines


def render(records: list[dict], **kw) -> str:
    return "\n".join(declaration_lines(records, **kw))
