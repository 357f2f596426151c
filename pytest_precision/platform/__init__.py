"""Facts of the machine a run is on, below every other layer: the device's fingerprint and
numerics key, xdist workers' GPUs (``devices``); whether and how Triton code runs here
(``triton``), the interpreter's bfloat16 defects measured (``triton_canary``) and computed as a GPU
does (``interpreter_bf16``); the Triton kernels a call launched (``launches``); whether a process
is still running (``processes``). Imports nothing of the package."""
