"""Triton kernels (installed as ``pytest_precision.kernels``): built-in targets of the suites and
the GPU checking engine. Importing this package imports no triton.

- ``softmax``: fused softmax / log-softmax with the log-sum-exp;
- ``flash_attention``: flash attention, forward and backward;
- ``error_stats``: one-pass error statistics;
- ``accurate``: exp as accurate compiled as interpreted;
- ``runtime``: how the kernels are launched (CUDA or the interpreter), and the interpreter's traps;
- ``builtin``: the kernels as the suites' built-in targets;
- ``compile_check``: every kernel compiled for sm_80 and sm_90 without a GPU;
- ``bench``: their speed."""
