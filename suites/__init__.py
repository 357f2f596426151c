"""The built-in kinds run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``),
one module per kind, each written as a user's kind is, from ``pytest_precision.kinds`` alone
(``tests/test_public_surface.py`` holds them to it): a ``TensorKind`` (targets that return a
tensor) or, for training, the training package's own kind:

- ``softmax.py``: softmax and log_softmax (suite ``softmax``);
- ``attention.py``: attention, with its SDPA backend variants (its masks in ``attention_masks.py``);
- ``norm.py``: layer_norm and rms_norm (suite ``norm``);
- ``cross_entropy.py``: cross_entropy, a loss over class targets;
- ``op.py``: op, any tensor operation declared as data at registration (one call of it in
  ``op_call.py``);
- ``training.py``: train_step (suite ``training``), whose machinery is
  ``pytest_precision.training.kind``; its built-in target in ``tiny_gpt.py``.

``pytest_precision.kinds.registry`` names the kinds by import path and imports a module the first
time its kind is needed."""
