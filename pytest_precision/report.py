"""Public path of ``pytest_precision.reporting.report``: the JSON and Markdown reports."""
from .reporting.report import *  # noqa: F401,F403
from .reporting.report import __all__  # noqa: F401
