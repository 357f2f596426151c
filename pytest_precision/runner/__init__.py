"""The pytest runner (``pytest_precision.plugin`` wires pytest's hooks to these):

- ``option_table``: the options and ini keys, declared once;
- ``options``: a run's options and records;
- ``collection``: the suite's items;
- ``variants``: a target's variants, decided at collection without letting the target touch the session;
- ``timelimit``: a case's time limit;
- ``exits``: what the code under test may not do to the run (end it, leave threads running);
- ``fixtures``: the fixtures of users' tests (``precision_config``, ``golden``);
- ``outputs``: the files a run leaves;
- ``worker_output``: what an xdist worker hands its controller;
- ``seed_memory``: the failing fresh and drawn seeds, kept in pytest's cache and replayed first."""
