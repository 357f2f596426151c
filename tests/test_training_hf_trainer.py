"""The Hugging Face Trainer as a train_step target (``pytest_precision.training.hf_trainer``): a tiny
Llama built from a config (no weights downloaded) stepped by the Trainer's own code under the
training configs, the same parameters as ``Trainer.train()``, and two mistakes a Trainer user makes
caught. Skipped without transformers and accelerate (the ``hf`` extra)."""
import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from pytest_precision.training import TRAIN_CONFIGS, run_training  # noqa: E402
from pytest_precision.training.hf_trainer import trainer_spec  # noqa: E402

pytest_plugins = ["pytester"]

# the conftest of the sessions: a repository's Trainer setup; TRAINER picks the Trainer class
CONFTEST = """
import torch
import pytest_precision
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from pytest_precision.training.hf_trainer import trainer_spec


def model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def examples():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        ids = torch.randint(0, 256, (32,), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


class ClipInStep(Trainer):
    # clips in training_step, right after backward: under fp16 the gradients are still scaled
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss


class OwnLoss(Trainer):
    # a compute_loss of its own that drops num_items_in_batch: the Trainer still takes the loss as
    # normalised over the accumulated micro-batches and does not divide it
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def recompute_without_autocast():  # a context_fn whose recompute leaves the forward's autocast
    import contextlib
    return contextlib.nullcontext(), torch.autocast("cpu", enabled=False)


ARGS = TrainingArguments(output_dir="trainer_output", report_to="none", per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=MAX_GRAD_NORM, fp16=True,
                         save_strategy="no", disable_tqdm=True, **EXTRA_ARGS)
pytest_precision.register("llama_trainer", trainer_spec(model, ARGS, examples(), steps=2, trainer_cls=TRAINER),
                          kind="train_step")
"""


def conftest(trainer="Trainer", max_grad_norm=1.0, extra_args="{}"):
    return (CONFTEST.replace("TRAINER", trainer).replace("MAX_GRAD_NORM", repr(max_grad_norm))
            .replace("EXTRA_ARGS", extra_args))


ARGS = ("--precision-suite", "-p", "no:cacheprovider", "-k", "train_step and not ddp",
        "--precision-configs=fp32,amp-bf16,amp-fp16")


def test_trainer_spec_passes_and_catches_a_compute_loss_dropping_num_items(pytester):
    pytester.makeconftest(conftest())
    pytester.runpytest(*ARGS, "--precision-update-baselines")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=4)
    for config in ("fp32", "amp-bf16", "amp-fp16", "amp-fp16-noscale"):
        result.stdout.fnmatch_lines([f"| llama_trainer *| {config} *| *2 |*| pass *|"])
    # the same Trainer with a compute_loss of its own that drops num_items_in_batch: its loss is no
    # longer divided by the 2 micro-batches; max_grad_norm=1 clips both runs' gradients to norm 1. The
    # Trainer's 2 backward passes per optimizer step are judged as accumulate=2 on the first run, and
    # against the golden the fp32 reference moved
    pytester.makeconftest(conftest("OwnLoss"))
    result = pytester.runpytest(*ARGS)
    result.stdout.fnmatch_lines(["*train_step[[]llama_trainer-fp32-trajectory[]]: FAIL accuracy,regression (golden: "
                                 "the fp32 reference moved*first-step gradient norm 1.00 x the golden's, loss 2.00 x: "
                                 "the loss exactly the 2 micro-batches a step accumulates and the applied gradient "
                                 "unchanged*no longer divided by the number of micro-batches*clip_grad_norm_ clips both*"
                                 "2 backward passes per optimizer.step() with no accumulate= declared*the loss of each "
                                 "micro-batch was not divided by the 2 micro-batches (loss / 2))"])
    first = pytester.runpytest(*ARGS, "-k", "train_step and fp32-trajectory", "--override-ini=precision_baseline_dir=none_yet")
    first.stdout.fnmatch_lines(["*train_step[[]llama_trainer-fp32-trajectory[]]: FAIL accuracy,baseline (*the loss of "
                                "each micro-batch was not divided by the 2 micro-batches (loss / 2))*"])


def test_clipping_inside_training_step_fails_amp_fp16_only(pytester):
    pytester.makeconftest(conftest("ClipInStep", max_grad_norm=0.0))
    result = pytester.runpytest(*ARGS, "--precision-update-baselines")
    result.stdout.fnmatch_lines(["*train_step[[]llama_trainer-amp-fp16-trajectory[]]: FAIL accuracy*gradient norm *"
                                 "a cosine of 0.6* with fp32's and norm 1 / the loss scale*clipped to norm 1 before "
                                 "scaler.unscale_(optimizer)*clip after unscale_*"])
    for config in ("fp32", "amp-bf16"):
        result.stdout.fnmatch_lines([f"| llama_trainer *| {config} *| *2 |*| pass *|"])


def test_activation_checkpointing_in_the_arguments_is_judged(pytester):
    """TrainingArguments(activation_checkpointing=True) is what Trainer.train() turns on; the spec
    turns it on for the checkpointed step: as written it gives the same bits, and checkpoint kwargs
    whose context_fn leaves autocast are caught under amp-bf16."""
    pytester.makeconftest(conftest(extra_args='{"activation_checkpointing": True}'))
    args = ("--precision-suite", "-p", "no:cacheprovider", "-k", "trajectory", "--precision-configs=fp32,amp-bf16",
            "--precision-update-baselines")
    pytester.runpytest(*args).assert_outcomes(passed=2)
    pytester.makeconftest(conftest(extra_args='{"activation_checkpointing": True, "activation_checkpointing_kwargs": '
                                              '{"use_reentrant": False, "context_fn": recompute_without_autocast}}'))
    result = pytester.runpytest(*args)
    result.stdout.fnmatch_lines(["*train_step[[]llama_trainer-amp-bf16-trajectory[]]: FAIL accuracy (*the recompute of "
                                 "model.layers.* ran with autocast off where its forward ran under autocast bfloat16*"])
    result.assert_outcomes(passed=1, failed=1)


def test_trainer_spec_steps_as_trainer_train(tmp_path):
    """Two steps of trainer_spec (2 micro-batches, clipping, warmup) leave the parameters bit for bit
    where Trainer.train() leaves them on the same batches, in fp32, bf16 and fp16 with its GradScaler
    (on a CPU both given the autocast and scaler accelerate builds on a GPU), with a callback that
    halves the gradients before the optimizer step."""
    def model_fn():
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (8, 16), generator=g)]

    class InOrder(Trainer):  # Trainer.train() on the batches trainer_spec gives: in order
        def _get_train_sampler(self, *a, **k):
            return SequentialSampler(self.train_dataset)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if self.args.fp16 and not self.accelerator.native_amp:
                self.accelerator.native_amp, self.accelerator.scaler = True, torch.amp.GradScaler("cpu")

    class Halve(TrainerCallback):  # a callback that changes the gradients before the optimizer step
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for p in kwargs["model"].parameters():
                p.grad.mul_(0.5)

    for config, fp16 in (("fp32", False), ("amp-bf16", False), ("amp-fp16", True)):
        args = TrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-3, warmup_steps=1,
                                 max_steps=2, save_strategy="no", disable_tqdm=True, use_cpu=True, fp16=fp16,
                                 bf16=config == "amp-bf16")
        t = run_training(trainer_spec(model_fn, args, data, steps=2, callbacks=[Halve()]), TRAIN_CONFIGS[config], "cpu")
        assert t.backward_passes == [2, 2] and t.skipped == []
        torch.manual_seed(0)
        model = model_fn()
        InOrder(model=model, args=args, train_dataset=data, callbacks=[Halve()]).train()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), t.final[n]), (config, n)


def test_trainer_spec_names_bad_arguments(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}]
    with pytest.raises(TypeError, match="training_args must be a transformers.TrainingArguments, got dict"):
        trainer_spec(LlamaForCausalLM, {"bf16": True}, data)
    with pytest.raises(TypeError, match="trainer_cls must be transformers.Trainer or a subclass"):
        trainer_spec(LlamaForCausalLM, args, data, trainer_cls=object)
    with pytest.raises(TypeError, match="train_dataset must support len.. and indexing.*got generator"):
        trainer_spec(LlamaForCausalLM, args, (d for d in data))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        trainer_spec(LlamaForCausalLM, args, [])
    with pytest.raises(TypeError, match="optimizers are set by trainer_spec, not through trainer_kwargs"):
        trainer_spec(LlamaForCausalLM, args, data, optimizers=(None, None))


def test_trainer_spec_passes_keep_fp32_and_seeds_on(tmp_path):
    """A head the repository keeps in float32, declared through trainer_spec: under the Trainer's
    bf16 autocast it ran in bf16, and the run says so."""
    def model_fn():
        return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (4, 16), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, max_steps=1,
                             save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=True)
    spec = trainer_spec(model_fn, args, data, steps=1, keep_fp32="lm_head", seeds=3)
    assert spec.keep_fp32 == ("lm_head",) and spec.seeds == 3
    t = run_training(spec, TRAIN_CONFIGS["amp-bf16"], "cpu")
    assert [f for f in t.module_failures if "lm_head" in f.sentence and f.category == "dtype"], t.module_failures
    assert not run_training(spec, TRAIN_CONFIGS["fp32"], "cpu").module_failures
    # checkpointing only where the arguments ask for it, turned on as Trainer.train() does
    assert spec.checkpoint is None
    checkpointed = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                     activation_checkpointing=True)
    model = model_fn()
    trainer_spec(model_fn, checkpointed, data).checkpoint(model)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
