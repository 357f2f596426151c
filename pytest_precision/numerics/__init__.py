"""Numerics: format facts and ULP arithmetic (``formats``), one comparison of an output with its
reference (``metrics``), error budgets (``budgets``), the precision configs (``configs``), seeded
inputs (``inputs``) and the numerics key of a machine (``devices``). Depends on nothing else of
the package."""
