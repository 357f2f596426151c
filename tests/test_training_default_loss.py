"""The default loss of a train_step target (``compute_loss``): a Hugging Face model given a pair
(tokens, next tokens) gets them as labels and its ``.loss`` is taken; the contract error names the fix
for nanoGPT's (logits, loss) and for Hugging Face's ``.loss``. And a fused optimizer stepped by a
GradScaler without ``unscale_`` (the Trainer's default AdamW) is recorded with the applied gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_precision.training import (TRAIN_CONFIGS, LossContractError, MarkovText, TrainSpec, compute_loss,
                                       run_training)


class LogitsAndLoss(nn.Module):
    """As nanoGPT: forward(idx, targets) returns (logits, loss)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 16)

    def forward(self, idx, targets):
        logits = self.emb(idx)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_contract_error_names_the_fix_for_both_conventions():
    x, y = MarkovText(vocab_size=16, batch_size=2, block_size=8)(0)
    with pytest.raises(LossContractError) as e:
        compute_loss(LogitsAndLoss(), (x, y))
    msg = str(e.value)
    assert "returned tuple of 2 (Tensor, Tensor), not a scalar loss tensor" in msg
    assert "(nanoGPT): def loss_fn(model, batch): return model(*batch)[1]" in msg
    assert "for a Hugging Face model, pass the targets as labels and take .loss" in msg


def tiny_llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))


def test_hf_causal_lm_pair_is_its_next_token_loss():
    model = tiny_llama()
    x, y = MarkovText(vocab_size=64, batch_size=2, block_size=16)(0)
    # before: model(x, y) passed the next tokens as attention_mask and returned no loss
    expected = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
    assert torch.equal(compute_loss(model, (x, y)), expected)
    # Hugging Face's own convention (labels = input_ids, shifted by the model) stays as it was
    assert torch.equal(compute_loss(model, (x, x)), model(input_ids=x, labels=x).loss)
    assert torch.equal(compute_loss(model, {"input_ids": x, "labels": x}), model(input_ids=x, labels=x).loss)


def test_hf_gpt2_pair_is_its_next_token_loss():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))
    x, y = MarkovText(vocab_size=64, batch_size=2, block_size=16)(0)
    expected = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
    assert torch.equal(compute_loss(model, (x, y)), expected)


def test_hf_output_without_labels_names_the_fix():
    model = tiny_llama()
    x, _ = MarkovText(vocab_size=64, batch_size=2, block_size=16)(0)
    with pytest.raises(LossContractError, match=r"returned CausalLMOutputWithPast whose \.loss is None.*labels"):
        compute_loss(model, {"input_ids": x})


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_fn(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def scaled_step(model, optimizer, scaler, b, autocast):  # no unscale_: the fused AdamW unscales itself
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        loss = loss_fn(model, b)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def test_fused_optimizer_scaled_step_records_the_applied_gradients():
    spec = TrainSpec(mlp, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), batch, steps=2, step_fn=scaled_step,
                     loss_fn=loss_fn)
    fp32 = run_training(spec, TRAIN_CONFIGS["fp32"], "cpu")
    fp16 = run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu")
    assert fp16.scales_used == [65536.0, 65536.0] and fp16.skipped == []
    # the optimizer saw the gradients x 65536 and divided them itself: the record is the applied ones
    for step in (0, 1):
        assert fp16.grad_norms[step] == pytest.approx(fp32.grad_norms[step], rel=1e-2)


def test_fused_optimizer_overflow_is_a_skipped_step():
    def overflow_first(model, optimizer, scaler, b, autocast):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model, b) * (1e30 if not overflow_first.done else 1.0)
        overflow_first.done = True
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss
    overflow_first.done = False
    spec = TrainSpec(mlp, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True), batch, steps=2, step_fn=overflow_first,
                     loss_fn=loss_fn)
    t = run_training(spec, TRAIN_CONFIGS["amp-fp16"], "cpu")
    assert t.skipped == [0] and t.first_step == 1
