"""Benchmarks that print numbers (not run by the test suite): the speed gate's false-alarm rate
on unchanged code (``false_alarms``) and a model repository's precision run, where its time goes
(``model_repo``). Run each with ``python -m pytest_precision.benchmarks.<name>``."""
