"""Triton kernels (installed as ``pytest_precision.kernels``): built-in targets and the GPU
checking engine. None yet: see the issue tracker."""
