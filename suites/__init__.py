"""The built-in kinds run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``),
one module per kind, each written as a user's kind is, from ``pytest_precision.kinds`` (the train_step
kind also from the training engine it drives, ``pytest_precision.training``;
``tests/test_public_surface.py`` holds them to it): a ``TensorKind`` (targets that return a tensor)
or, for training, a plain kind:

- ``softmax``: softmax and log_softmax (suite ``softmax``);
- ``attention``: attention, with its SDPA backend variants;
- ``attention_masks``: the attention kind's masks, oracle and peer, and the fully masked row's
  conventions;
- ``attention_floors``: the floors under the attention kind's budgets (what fp32 arithmetic leaves in
  any kernel, the gradients' cancelled terms included);
- ``attention_regimes``: the attention kind's seeded regimes and its fresh regime;
- ``norm``: layer_norm and rms_norm (suite ``norm``);
- ``norm_inputs``: the norm kinds' inputs, seeded regimes and fresh regime;
- ``cross_entropy``: cross_entropy, a loss over class targets;
- ``cross_entropy_inputs``: the cross_entropy kind's inputs, seeded regimes and fresh regime;
- ``op``: op, any tensor operation declared as data at registration;
- ``op_inputs``: an op target's ``inputs=`` declaration, normalised, and the inputs as a config's
  arithmetic may move them;
- ``op_call``: one regime's inputs of an op target, as it is called with them, and what a call returned
  wrong;
- ``training``: train_step (suite ``training``);
- ``training_report``: what a train_step case shows, and the training summary table;
- ``training_seeds``: the success-rate cases;
- ``training_faults``: the first op that lost a value in a failing training step;
- ``distributed_case``: the one-step distributed cases, written once;
- ``ddp``: the DDP compression-hook cases;
- ``fsdp``: the FSDP2 mixed-precision cases;
- ``tiny_gpt``: the training suite's built-in target.

``pytest_precision.kinds.registry`` names the kinds by import path and imports a module the first
time its kind is needed."""
