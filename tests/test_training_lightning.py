"""A LightningModule through lightning_spec (training.lightning): the harness's steps are a real
Trainer(...).fit's, bit for bit, in each precision; correct modules pass every single-process CPU
config on a first run and are accepted, the shipped precision's row marked; a defect planted in each
option that changes numerics (accumulation, clipping, the module's clipping hook, manual
optimisation) fails on a first run, naming its cause. Modules: tests/lit_modules.py."""
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed (pip install -e '.[lightning]')")

import lit_modules as L  # noqa: E402
from pytest_precision.training import TRAIN_CONFIGS, run_training  # noqa: E402
from pytest_precision.training.lightning import lightning_spec  # noqa: E402

pytest_plugins = ["pytester"]

CLIP = dict(gradient_clip_val=0.5, gradient_clip_algorithm="norm")
CONFIG = {"32-true": "fp32", "bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16"}


def _fit(cls, precision, steps, **kwargs):
    """A real Trainer.fit of ``steps`` optimizer steps on L.batches(), from the harness's seed; its module."""
    from pytorch_lightning.plugins.precision import MixedPrecision
    torch.manual_seed(0)
    module = cls()
    # Lightning turns 16-mixed into bf16-mixed on a CPU; the plugin keeps float16, as on a GPU
    chosen = dict(plugins=[MixedPrecision("16-mixed", "cpu")]) if precision == "16-mixed" else dict(precision=precision)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **chosen, **kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(L.batches(), batch_size=None))
    return module


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("cls, precision, kwargs", [
    (L.Lit, "32-true", dict(accumulate_grad_batches=2, **CLIP)),
    (L.Lit, "bf16-mixed", dict(accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="value")),
    (L.Lit, "16-mixed", dict(accumulate_grad_batches=2, **CLIP)),
    (L.OwnClipping, "16-mixed", CLIP),
    (L.Manual, "16-mixed", {}),
], ids=["accumulate-clip-fp32", "accumulate-clip-value-bf16", "accumulate-clip-fp16", "own-clipping-fp16", "manual-fp16"])
def test_the_harness_steps_are_trainer_fits_bit_for_bit(cls, precision, kwargs):
    fitted = _fit(cls, precision, 4, **kwargs)
    run = run_training(lightning_spec(cls, L.batches(), steps=4, precision=precision, **kwargs),
                       TRAIN_CONFIGS[CONFIG[precision]], "cpu")
    for name, p in fitted.named_parameters():
        assert torch.equal(run.final[name], p.detach()), name


MODULES = """
import pytest_precision
import lit_modules as L
from pytest_precision.training.lightning import lightning_spec

clip = dict(gradient_clip_val=0.5, gradient_clip_algorithm="norm")
for name, cls, kw in (("lit", L.Lit, dict(accumulate_grad_batches=2, **clip)), ("own_clipping", L.OwnClipping, clip),
                      ("manual", L.Manual, {}),
                      ("zero_grad_each_batch", L.ZeroGradEachBatch, dict(accumulate_grad_batches=2)),
                      ("clips_after_backward", L.ClipsAfterBackward, dict(accumulate_grad_batches=2)),
                      ("unscales_again", L.UnscalesAgain, clip), ("manual_plain_backward", L.ManualPlainBackward, {})):
    pytest_precision.register(name, lightning_spec(cls, L.batches(), steps=4, precision="bf16-mixed", **kw),
                              kind="train_step")
"""
CORRECT = ("lit", "own_clipping", "manual")
SINGLE = ("fp32", "amp-bf16 (shipped)", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3", "fp8-tensorwise",
          "fp8-delayed")


def test_lightning_modules_pass_first_run_and_each_planted_defect_fails(pytester):
    pytester.makeconftest(MODULES)
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "-k",
                                "train_step and trajectory and not ddp and not fsdp", "--precision-update-baselines")
    for target in CORRECT:
        result.stdout.fnmatch_lines([f"| {target} *| {config} *| pass *|" for config in SINGLE])
        assert len(list((pytester.path / "precision_baselines/train_step" / target).rglob("*.npz"))) == len(SINGLE)
    # accumulation: zero_grad in on_train_batch_start, every config
    result.stdout.fnmatch_lines([f"| zero_grad_each_batch *| {config} *| FAIL accuracy *|" for config in SINGLE])
    result.stdout.fnmatch_lines(["*[[]zero_grad_each_batch-amp-bf16-trajectory[]]: FAIL accuracy (2 backward passes per "
                                 "optimizer.step() with no accumulate= declared*only the last micro-batch's gradient "
                                 "reached the optimizer*"])
    # clipping in on_after_backward: per micro-batch, before the plugin unscales (fp16's scaler)
    result.stdout.fnmatch_lines(["*[[]clips_after_backward-amp-fp16-trajectory[]]: FAIL accuracy (*they were clipped to "
                                 "norm 0.5 before scaler.unscale_(optimizer)*"])
    # the clipping hook that unscales again
    result.stdout.fnmatch_lines(["*[[]unscales_again-amp-fp16-trajectory[]]: FAIL accuracy (gradient norm * x fp32's at "
                                 "step 0 (*), about 1 / the loss scale 65536*"])
    # manual optimisation: loss.backward() in place of self.manual_backward(loss)
    result.stdout.fnmatch_lines(["*[[]manual_plain_backward-amp-fp16-trajectory[]]: *Attempted unscale_ but _scale is "
                                 "None*the loss's backward ran past the GradScaler: loss.backward() in place of "
                                 "scaler.scale(loss).backward() (in Lightning's manual optimisation, in place of "
                                 "self.manual_backward(loss))*"])
    for target, config in (("clips_after_backward", "amp-fp16"), ("unscales_again", "amp-fp16"),
                           ("manual_plain_backward", "amp-fp16")):
        result.stdout.fnmatch_lines([f"| {target} *| {config} *| FAIL *|"])
