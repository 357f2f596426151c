"""The pytest runner: the run's options and records (``options``), the suite's items
(``collection``), the fixtures of users' tests (``fixtures``) and the files a run leaves
(``outputs``). ``pytest_precision.plugin`` wires pytest's hooks to these."""
