"""Triton kernels (installed as ``pytest_precision.kernels``): built-in targets of the suites and
the GPU checking engine. ``softmax`` (fused softmax / log-softmax with log-sum-exp),
``flash_attention`` (forward and backward), ``error_stats`` (one-pass error statistics),
``accurate`` (exp as accurate as the interpreter's), ``runtime`` (CUDA or the interpreter, and its
bf16 traps), ``builtin`` (the kernels as the suites' built-in targets), ``compile_check`` (every
kernel compiled for sm_80 and sm_90 without a GPU), ``bench`` (their speed). Importing this package
imports no triton."""
