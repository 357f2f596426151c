"""Numerics, depending on nothing else of the package:

- ``formats``: format facts and ULP arithmetic;
- ``metrics``: one comparison of an output with its reference;
- ``describe``: the one comparison block every message shows;
- ``budgets``: error budgets (the peer's and the regression's);
- ``problem``: a problem a check found, and the category order;
- ``configs``: the precision configs;
- ``inputs``: seeded inputs with the same bits on every machine;
- ``gates``: gates across sigmoid's saturation, for gated activations;
- ``rng``: torch's random generators, captured and replayed;
- ``global_state``: torch's process-wide state, snapshotted around a user's call;
- ``promote``: code that casts to float32, run exactly (float32 read as float64)."""
