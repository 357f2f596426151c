"""Triton kernels (installed as ``pytest_precision.kernels``): built-in targets of the suites and
the GPU checking engine. ``softmax`` (fused softmax / log-softmax with log-sum-exp),
``flash_attention`` (forward and backward), ``error_stats`` (one-pass error statistics),
``runtime`` (CUDA or the interpreter, and its bf16 traps), ``targets``, ``bench``. Importing this
package imports no triton."""
