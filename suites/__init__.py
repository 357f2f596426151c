"""The built-in kinds run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``),
one module per kind, each written as a user's kind is, from ``pytest_precision.kinds`` (the train_step
kind also from the training engine it drives, ``pytest_precision.training``;
``tests/test_public_surface.py`` holds them to it): a ``TensorKind`` (targets that return a tensor)
or, for training, a ``Kind``:

- ``softmax.py``: softmax and log_softmax (suite ``softmax``);
- ``attention.py``: attention, with its SDPA backend variants (its masks in ``attention_masks.py``, its
  seeded and fresh regimes in ``attention_regimes.py``);
- ``norm.py``: layer_norm and rms_norm (suite ``norm``; their inputs and regimes in ``norm_inputs.py``);
- ``cross_entropy.py``: cross_entropy, a loss over class targets;
- ``op.py``: op, any tensor operation declared as data at registration (one call of it in
  ``op_call.py``, its inputs declaration in ``op_inputs.py``);
- ``training.py``: train_step (suite ``training``), with what its cases show in
  ``training_report.py``, its success-rate cases in ``training_seeds.py``, the first op that lost a
  value in ``training_faults.py``, its one-step distributed cases in ``distributed_case.py`` (DDP's
  in ``ddp.py``, FSDP2's in ``fsdp.py``) and its built-in target in ``tiny_gpt.py``.

``pytest_precision.kinds.registry`` names the kinds by import path and imports a module the first
time its kind is needed."""
