"""The pytest runner: the options and ini keys, declared once (``option_table``), the run's options
and records (``options``), the suite's items (``collection``), the fixtures of users' tests
(``fixtures``), the files a run leaves (``outputs``), what an xdist worker hands its controller
(``worker_output``) and the failing fresh and drawn seeds replayed first (``seed_memory``). ``pytest_precision.plugin`` wires pytest's hooks to these."""
