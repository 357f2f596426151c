"""What a golden's JSON may hold, and how values read from one are shown and compared.

The documented structure and types of a golden's metadata (:func:`meta_problem`), the limits
pytest-precision itself writes as unlimited (``UNLIMITED_WHEN``, :func:`unlimited`), and
:class:`BaselineError`, what reading an untrusted file raises. A value from a file is shortened
(:func:`shown`, :func:`named`) in every message: a golden arrives in a pull request, and may hold a
string of 500 MB.
"""
from __future__ import annotations

import math

__all__ = ["SCHEMA_VERSION", "BaselineError", "shown", "named", "is_number", "same_value", "meta_problem",
           "UNLIMITED_WHEN", "unlimited"]

SCHEMA_VERSION = 1


class BaselineError(Exception):
    """A baseline file that cannot be trusted: corrupt, truncated, of another schema, with fields of
    the wrong type, or not the pair it was written as. ``newer_schema``: the version, when the
    file was written by a newer pytest-precision (upgrading is the fix, not rewriting)."""

    def __init__(self, message: str, *, newer_schema: int | None = None):
        super().__init__(message)
        self.newer_schema = newer_schema


SHOWN = 120  # characters of a value from a file that a message repeats


def shown(value, limit: int = SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was: a value from a file is
    repeated in messages, and a file may hold a string of 500 MB."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def named(name: str, limit: int = 60) -> str:
    """A name from a file as a message shows it: as it is when short and printable, else ``shown``."""
    return name if isinstance(name, str) and len(name) <= limit and name.isprintable() else shown(name, limit)


def is_number(v) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def same_value(a, b) -> bool:
    """Two values read from goldens are the same: equal, a NaN the same as a NaN (a stored NaN
    rewritten is no change), lists element by element."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if is_number(a) and is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _kind(v) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(v), "a number" if is_number(v) else type(v).__name__)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, bool)) or is_number(v)


def meta_problem(meta: dict) -> str | None:
    """The first field of ``meta`` that is not of its documented type, as a sentence, or None.

    Top level: strings (key, config, torch, written_on, input_checksum, npz_sha256), an integer
    or null seed, an object or null input_spec of plain values, ``dtypes`` {output: string},
    ``budgets`` {numerics key: {"outputs": {output: {"budget": {field: number or null},
    "accepted": {field: number, string or null}}}, other fields plain values or lists of
    numbers}}, ``speed`` {fingerprint: {field: plain value or list of numbers}}."""
    def expect(where, value, ok, what):
        return None if ok(value) else f"{where} is {_kind(value)}, expected {what}"

    checks = [expect(k, meta[k], lambda v: isinstance(v, str), "a string")
              for k in ("key", "config", "torch", "written_on", "npz_sha256") if k in meta]
    checks += [expect(k, meta[k], lambda v: v is None or isinstance(v, str), "a string or null")
               for k in ("input_checksum",) if k in meta]
    if "seed" in meta:
        checks.append(expect("seed", meta["seed"], lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
                             "an integer or null"))
    if meta.get("input_spec") is not None:
        checks.append(_object_of("input_spec", meta["input_spec"], lambda v: _scalar(v) or _plain_list(v), "plain values"))
    if "dtypes" in meta:
        checks.append(_object_of("dtypes", meta["dtypes"], lambda v: isinstance(v, str), "strings"))
    if "budgets" in meta:
        checks.append(_budgets_problem(meta["budgets"]))
    if "speed" in meta:
        speed = meta["speed"]
        checks.append(expect("speed", speed, lambda v: isinstance(v, dict), "an object"))
        if isinstance(speed, dict):
            for fp, rec in speed.items():
                checks.append(_object_of(f"speed.{named(fp)}", rec, lambda v: _scalar(v) or _numbers(v),
                                         "plain values or lists of numbers"))
                if isinstance(rec, dict):
                    checks.append(_speed_problem(f"speed.{named(fp)}", rec))
    return next((c for c in checks if c), None)


# the speed record's fields the gate reads: times and bytes, finite and not negative
_SPEED_FIELDS = ("median_s", "samples", "calibration", "peak_bytes")


def _speed_problem(where: str, record: dict) -> str | None:
    for name in _SPEED_FIELDS:
        values = record.get(name)
        if name in ("samples", "calibration") and values is not None and not (
                isinstance(values, list) and all(is_number(v) for v in values)):
            return f"{where}.{name} is not a list of numbers"
        for v in values if isinstance(values, list) else [values]:
            if is_number(v) and not (math.isfinite(v) and v >= 0):
                return f"{where}.{name} holds {v!r}: a time or a size is finite and not negative"
    return None


# The limits pytest-precision itself writes as infinite, and the accepted value that makes them so
# (training.budget): a training golden accepted with a gradient-norm or update ratio that was not
# finite (or zero), or a loss deviation that was not finite, has an upper limit of +Infinity on
# it; one accepted with an SQNR of -Infinity or NaN (a non-finite gradient or parameter), a lower
# limit of -Infinity. Such a limit is read, and the check says the metric is not judged; any other
# loosening infinity is refused. The training budgets' JSON keys, spelled here because this layer
# reads every golden and cannot import the training layer (tests/test_training_budget.py holds
# them to what training.budget writes).
UNLIMITED_WHEN = {"max_grad_norm_log_ratio": "grad_norm_ratio", "max_update_log_ratio": "update_ratio",
                  "max_loss_deviation": "max_loss_deviation", "min_grad_sqnr_db": "grad_sqnr_db",
                  "min_worst_grad_sqnr_db": "worst_grad_sqnr_db", "min_param_sqnr_db": "param_sqnr_db"}


def _loosening(field: str, v) -> bool:
    """Whether ``v`` is the infinity that lets every result pass (``min_*`` are lower bounds)."""
    return is_number(v) and v == (-math.inf if field.startswith("min_") else math.inf)


def _accepted_value(field: str, accepted, name: str | None):
    source = UNLIMITED_WHEN.get(field)
    v = accepted.get(source) if source and isinstance(accepted, dict) else None
    return v.get(name) if isinstance(v, dict) and name is not None else v


def _unlimited_by_acceptance(field: str, accepted, name: str | None = None) -> bool:
    v = _accepted_value(field, accepted, name)
    if not is_number(v):
        return False
    if field.startswith("min_"):
        return math.isnan(v) or v == -math.inf
    return not math.isfinite(v) or (field.endswith("_log_ratio") and v <= 0)


def unlimited(entry: dict) -> list[str]:
    """The limits of one stored output (``{"budget", "accepted"}``) that are infinite because
    what was accepted was not finite, as "field (accepted source value)"."""
    budget, accepted = entry.get("budget") or {}, entry.get("accepted") or {}
    out = []
    for f, value in budget.items():
        for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            if _loosening(f, v) and _unlimited_by_acceptance(f, accepted, name):
                at = f"{f}.{named(name)}" if name is not None else f
                out.append(f"{at} (accepted {UNLIMITED_WHEN[f]} {_accepted_value(f, accepted, name)!r})")
    return out


def _limit_problem(where: str, field: str, value, accepted=None) -> str | None:
    """Why a stored limit cannot judge: NaN, or infinite in the direction that lets everything
    pass, unless pytest-precision wrote it so (``UNLIMITED_WHEN``)."""
    for name, v in (value.items() if isinstance(value, dict) else [(None, value)]):
        if not is_number(v):
            continue
        at = f"{where}.{field}" + (f".{named(name)}" if name is not None else "")
        if math.isnan(v):
            return f"{at} is NaN: a NaN limit judges nothing (rewrite the golden)"
        if _loosening(field, v) and not _unlimited_by_acceptance(field, accepted, name):
            return (f"{at} is {v!r}: a limit that lets every result pass (pytest-precision writes one only where "
                    "what it accepted was not finite)")
    return None


def _plain_list(v) -> bool:
    return isinstance(v, list) and all(_scalar(x) or _plain_list(x) for x in v)


def _numbers(v) -> bool:
    return isinstance(v, list) and all(is_number(x) or x is None for x in v)


def _object_of(where: str, value, ok, what: str) -> str | None:
    if not isinstance(value, dict):
        return f"{where} is {_kind(value)}, expected an object"
    bad = next((k for k, v in value.items() if not ok(v)), None)
    if bad is None:
        return None
    return f"{where}.{shown(bad, 60) if len(str(bad)) > 60 else bad} is {_kind(value[bad])}, expected one of {what}"


def _limit(v) -> bool:
    return v is None or is_number(v) or (isinstance(v, dict) and all(is_number(x) for x in v.values()))


def _plain_value(v, depth: int = 3) -> bool:
    if _scalar(v):
        return True
    if depth == 0:
        return False
    if isinstance(v, list):
        return all(_plain_value(x, depth - 1) for x in v)
    return isinstance(v, dict) and all(isinstance(k, str) and _plain_value(x, depth - 1) for k, x in v.items())


def _budgets_problem(budgets) -> str | None:
    if not isinstance(budgets, dict):
        return f"budgets is {_kind(budgets)}, expected an object"
    for key, record in budgets.items():
        where = f"budgets.{named(key)}"
        if not isinstance(record, dict):
            return f"{where} is {_kind(record)}, expected an object"
        outputs = record.get("outputs")
        if not isinstance(outputs, dict):
            return f"{where}.outputs is {_kind(outputs)}, expected an object"
        for name, entry in outputs.items():
            name = named(name)
            if not isinstance(entry, dict):
                return f"{where}.outputs.{name} is {_kind(entry)}, expected an object"
            # a training budget holds some limits per parameter: objects of numbers
            budget = entry.get("budget")
            problem = (_object_of(f"{where}.outputs.{name}.budget", budget, _limit,
                                  "numbers, null or objects of numbers")
                       or next((p for f, v in budget.items()
                                if (p := _limit_problem(f"{where}.outputs.{name}.budget", f, v,
                                                        entry.get("accepted")))), None)
                       or _object_of(f"{where}.outputs.{name}.accepted", entry.get("accepted", {}), _plain_value,
                                     "numbers, strings, null, or lists and objects of them")
                       or _object_of(f"{where}.outputs.{name}.peer", entry.get("peer", {}),
                                     lambda v: v is None or is_number(v), "numbers or null"))
            if problem:
                return problem
        extra = {k: v for k, v in record.items() if k != "outputs"}
        problem = _object_of(where, extra, _plain_value, "numbers, strings, null, or lists and objects of them")
        if problem:
            return problem
    return None
