"""Facts of the machine a run is on, below every other layer (it imports nothing of the package):

- ``devices``: the device's fingerprint and numerics key, xdist workers' GPUs;
- ``processes``: whether a process is still running;
- ``triton``: whether and how Triton code runs here;
- ``triton_canary``: the interpreter's bfloat16 defects, measured;
- ``interpreter_bf16``: bfloat16 under the interpreter, computed as a GPU does;
- ``launches``: the Triton kernels a call launched;
- ``user_code``: where the user's code is (files, and the innermost line on the stack)."""
