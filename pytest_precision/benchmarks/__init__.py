"""Benchmarks that print numbers (not run by the test suite), each run with
``python -m pytest_precision.benchmarks.<name>``:

- ``false_alarms``: the speed gate's false-alarm rate on unchanged code, and how often it catches a
  planted slowdown, idle, under load and under ``-n 2``;
- ``model_repo``: a model repository's precision run, and where its time goes;
- ``success_rate``: the built-in GPT's failure rates over seeds, per training config, with plants;
- ``accumulation``: the accumulation and checkpointing verdicts on the built-in GPT, for correct
  loops and planted defects."""
