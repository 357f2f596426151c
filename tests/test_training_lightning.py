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


def _fit(cls, precision, steps, root, **kwargs):
    """A real Trainer.fit of ``steps`` optimizer steps on L.batches(), from the harness's seed; its module."""
    from pytorch_lightning.plugins.precision import MixedPrecision
    torch.manual_seed(0)
    module = cls()
    # Lightning turns 16-mixed into bf16-mixed on a CPU; the plugin keeps float16, as on a GPU
    chosen = dict(plugins=[MixedPrecision("16-mixed", "cpu")]) if precision == "16-mixed" else dict(precision=precision)
    checkpoints = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in kwargs.get("callbacks", []))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=checkpoints,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, **chosen,
                         **kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(L.batches(), batch_size=None))
    return module


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("cls, precision, kwargs", [
    (L.Lit, "32-true", dict(accumulate_grad_batches=2, **CLIP)),
    (L.Lit, "bf16-mixed", dict(accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="value")),
    (L.Lit, "16-mixed", dict(accumulate_grad_batches=2, **CLIP)),
    (L.OwnClipping, "16-mixed", CLIP),
    (L.Manual, "16-mixed", {}),
    (L.Warmup, "bf16-mixed", dict(accumulate_grad_batches=2, callbacks=[L.HalveGradients()], **CLIP)),
    (L.Warmup, "16-mixed", dict(callbacks=[L.HalveGradients()])),
    (L.ManualScheduled, "32-true", {}),
], ids=["accumulate-clip-fp32", "accumulate-clip-value-bf16", "accumulate-clip-fp16", "own-clipping-fp16", "manual-fp16",
        "warmup-callback-bf16", "warmup-callback-fp16", "manual-scheduler-fp32"])
def test_the_harness_steps_are_trainer_fits_bit_for_bit(cls, precision, kwargs, tmp_path):
    """Hooks, callbacks, schedulers (their frequency counted as Lightning counts it), global_step in a
    warmup, outputs in on_train_batch_end: as fit runs them."""
    fitted = _fit(cls, precision, 4, tmp_path, **kwargs)
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
                      ("manual", L.Manual, {}), ("self_call", L.BuildsItsScale, dict(accumulate_grad_batches=2, **clip)),
                      ("zero_grad_each_batch", L.ZeroGradEachBatch, dict(accumulate_grad_batches=2)),
                      ("clips_after_backward", L.ClipsAfterBackward, dict(accumulate_grad_batches=2)),
                      ("unscales_again", L.UnscalesAgain, clip), ("manual_plain_backward", L.ManualPlainBackward, {})):
    pytest_precision.register(name, lightning_spec(cls, L.batches(), steps=2, precision="bf16-mixed", **kw),
                              kind="train_step")
"""
CORRECT = ("lit", "own_clipping", "manual", "self_call")
SINGLE = ("fp32", "amp-bf16 (shipped)", "amp-fp16", "amp-fp16-noscale", "bf16", "bf16-sr", "fp8-e4m3", "fp8-tensorwise",
          "fp8-delayed")


def test_lightning_modules_pass_first_run_and_each_planted_defect_fails(pytester):
    pytester.makeconftest(MODULES)
    # single-process configs, and for the module calling self(x) in its step one DDP and one FSDP2 config: the
    # ranks run the step through the wrapper, the inner call reaching its forward (before, it re-entered
    # training_step and crashed); its forward builds a tensor in the default dtype, which FSDP2's bfloat16
    # param_dtype makes bfloat16 there as Lightning's "bf16-true" does (before, float != BFloat16)
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "-k",
                                "train_step and trajectory and (not ddp and not fsdp or self_call and (ddp-bf16 or "
                                "fsdp-bf16-trajectory))", "--precision-update-baselines")
    result.stdout.fnmatch_lines(["| self_call *| ddp-bf16 *| pass *|", "| self_call *| fsdp-bf16 *| pass *|"])
    for target in CORRECT:
        result.stdout.fnmatch_lines([f"| {target} *| {config} *| pass *|" for config in SINGLE])
        accepted = len(list((pytester.path / "precision_baselines/train_step" / target).rglob("*.npz")))
        assert accepted == len(SINGLE) + 2 * (target == "self_call")
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


def test_a_run_leaves_nothing_alive_and_keeps_out_what_is_not_numerics(tmp_path):
    """The module, its Trainer and optimizer are freed after a run (nothing keeps a table of runs); a
    ModelCheckpoint and a plateau scheduler are left out (no files, no monitored metric); a
    precision with no harness config marks no row."""
    import gc
    import weakref

    class Plateau(L.SelfCall):
        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "train_loss"}}
    made = []

    def module_fn():
        made.append(weakref.ref(m := Plateau()))
        return m
    spec = lightning_spec(module_fn, L.batches(), steps=2, precision="16-true",
                          callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path)])
    assert spec.ships is None
    run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu")
    gc.collect()
    assert made and all(ref() is None for ref in made)
    assert not list(tmp_path.iterdir())



DEMO = """
import pytest_precision
from pytest_precision.training import MarkovText
from pytest_precision.training.lightning import lightning_spec
from pytorch_lightning.demos.transformer import LightningTransformer


def make_module():
    return LightningTransformer(vocab_size=64)


data = MarkovText(vocab_size=64, batch_size=4, block_size=16)
pytest_precision.register("demo", lightning_spec(make_module, [data(i) for i in range(8)], steps=2,
                                                 accumulate_grad_batches=2, gradient_clip_val=1.0), kind="train_step")
"""


def test_lightnings_demo_transformer_accumulates_within_its_own_fp32_precision(pytester):
    """Lightning's own demo transformer, 2 micro-batches: its fp32 accumulated gradient keeps 91.4 dB
    against float64, and the accumulation floor is what its conditioning leaves, not 100 dB (before,
    the correct loop failed fp32)."""
    pytester.makeconftest(DEMO)
    result = pytester.runpytest("--precision-suite", "-p", "no:cacheprovider", "-k", "train_step and fp32-trajectory",
                                "--precision-update-baselines")
    result.assert_outcomes(passed=1)


def test_a_module_building_tensors_in_forward_runs_outside_lightnings_loop_as_bf16_true_runs_it():
    """The careful loop and the FSDP2 ranks call the module outside Lightning's loop: a tensor its
    forward builds with the default dtype matches its bfloat16 parameters there as under Lightning's
    "bf16-true" (before: the careful loop could not run, float != BFloat16), and the default is
    restored after."""
    from pytest_precision.training.lightning import lightning_loss
    from pytest_precision.training.peer import LoopPeer, run_peer

    spec = lightning_spec(L.BuildsItsScale, L.batches(), steps=2)
    assert isinstance(run_peer(spec, TRAIN_CONFIGS["bf16"], "cpu", "t", 1), LoopPeer)
    x, y = L.batches(1)[0]
    assert lightning_loss(L.BuildsItsScale().to(torch.bfloat16), (x.bfloat16(), y.bfloat16())).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # "bf16-mixed" keeps float32 the default
        assert lightning_loss(L.BuildsItsScale(), (x, y)).dtype == torch.float32


def test_a_step_that_leaves_the_default_dtype_changed_is_named_not_repaired():
    from pytest_precision.training.lightning import lightning_loss
    from pytest_precision.training.run import GlobalStateError

    x, y = L.batches(1)[0]
    with pytest.raises(GlobalStateError, match="training_step left torch's default dtype torch.float64 .*restored"):
        lightning_loss(L.LeavesFloat64().to(torch.bfloat16), (x.bfloat16(), y.bfloat16()))
    assert torch.get_default_dtype() == torch.float32
