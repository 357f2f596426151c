"""Numerics: format facts and ULP arithmetic (``formats``), one comparison of an output with its
reference (``metrics``), error budgets (``budgets``), the precision configs (``configs``), seeded
inputs (``inputs``), gates across sigmoid's saturation for gated activations (``gates``), torch's
random generators (``rng``), torch's process-wide state snapshotted around a user's call
(``global_state``), code that casts to float32 run exactly (``promote``), the one comparison block every
message shows (``describe``), a problem a check found and the category order (``problem``). Depends
on nothing else of the package."""
