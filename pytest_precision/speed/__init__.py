"""Speed (``pytest_precision.speed`` is the gate's public path):

- ``timing``: how long one call takes;
- ``gate``: the speed and memory gate;
- ``alignment``: the tensor-core alignment lint."""
from .gate import (DEFAULT_THRESHOLD, MEMORY_THRESHOLD, SpeedCheck, SpeedComparison, check_speed, judge_memory,
                   judge_speed, ratio_interval, thin_samples)

__all__ = ["DEFAULT_THRESHOLD", "MEMORY_THRESHOLD", "SpeedComparison", "ratio_interval", "judge_speed", "judge_memory",
           "thin_samples", "SpeedCheck", "check_speed"]
