"""Golden baselines: the files (``store``: read safely, written atomically), the one lifecycle every
golden goes through (``lifecycle``), which baselines a run used (``usage``) and the tools over a
directory of them (``tools``: list, show, diff, prune)."""
from .store import SCHEMA_VERSION, UPDATE_OPTION, Baseline, BaselineError, BaselineStore, checksum, sanitize_key

__all__ = ["SCHEMA_VERSION", "UPDATE_OPTION", "Baseline", "BaselineError", "BaselineStore", "checksum", "sanitize_key"]
