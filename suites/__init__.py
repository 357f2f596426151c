"""The built-in kinds run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``),
one module per kind, each kind a ``pytest_precision.kinds.TensorKind`` (targets that return a
tensor) or, for training, a ``pytest_precision.kinds.Kind``:

- ``softmax.py``: softmax and log_softmax (suite ``softmax``);
- ``attention.py``: attention, with its SDPA backend variants (its masks in ``attention_masks.py``);
- ``norm.py``: layer_norm and rms_norm (suite ``norm``);
- ``cross_entropy.py``: cross_entropy, a loss over class targets;
- ``op.py``: op, any tensor operation declared as data at registration (one call of it in
  ``op_call.py``);
- ``training.py``: train_step (suite ``training``), with what its cases show in
  ``training_report.py``, its success-rate cases in ``training_seeds.py``, the first op that lost a
  value in ``training_faults.py``, its one-step distributed cases in ``distributed_case.py`` (DDP's
  in ``ddp.py``, FSDP2's in ``fsdp.py``) and its built-in target in ``tiny_gpt.py``.

``pytest_precision.kinds.registry`` names the kinds by import path and imports a module the first
time its kind is needed."""
