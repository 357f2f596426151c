"""The built-in kinds run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``):
``softmax.py`` (the softmax and log_softmax kinds), ``attention.py`` (attention), ``training.py``
(train_step, with its DDP cases in ``ddp.py``) and ``tiny_gpt.py`` (the built-in training target).
Each kind is a ``pytest_precision.kinds.Kind``; ``pytest_precision.kinds.registry`` names them by
import path and imports a module the first time its kind is needed."""
