"""PyTorch Lightning modules as repositories write them, for tests/test_training_lightning.py: a small
regression model (``Lit``, automatic optimisation, ``self.log`` in its step), one stepping its own
optimizer (``Manual``), and each with a defect planted in one of the options that change numerics."""
import torch
import torch.nn.functional as F
import pytorch_lightning as pl
from torch import nn


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class OwnClipping(Lit):
    """Its own clipping hook, correct: the plugin has unscaled before it runs."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)


class ZeroGradEachBatch(Lit):
    """Accumulation defect: the gradients are zeroed before every micro-batch, so a step applies the last one's."""

    def on_train_batch_start(self, batch, batch_idx):
        self.optimizers().zero_grad()


class ClipsAfterBackward(Lit):
    """Clipping defect: clipped in on_after_backward, per micro-batch and before the plugin unscales."""

    def on_after_backward(self):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)


class UnscalesAgain(OwnClipping):
    """Clipping-hook defect: divides by the loss scale the plugin already took out."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            for p in self.parameters():
                p.grad /= scaler.get_scale()
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class Manual(Lit):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def backward_of(self, loss):
        self.manual_backward(loss)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)
        optimizer.zero_grad()
        self.backward_of(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss


class ManualPlainBackward(Manual):
    """Manual-optimisation defect: loss.backward() in place of self.manual_backward(loss), past the plugin's scaler."""

    def backward_of(self, loss):
        loss.backward()


def batches(n=16):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


class SelfCall(Lit):
    """The usual shape: forward for predictions, training_step calling self(x)."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return {"loss": loss, "size": x.shape[0]}


class Warmup(SelfCall):
    """A step scheduler, learning-rate warmup in optimizer_step read from global_step (Lightning's docs'
    pattern), outputs read in on_train_batch_end, a plateau scheduler on the logged loss."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * min(1.0, (self.trainer.global_step + 1) / 3)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        assert outputs["loss"].ndim == 0 and outputs["size"] == 8


class HalveGradients(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            p.grad.mul_(0.5)


class ManualScheduled(Manual):
    """Manual optimisation stepping its own scheduler (Lightning never steps it in this mode)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.lr_schedulers().step()
        return loss


class BuildsItsScale(SelfCall):
    """Builds a tensor in forward with the default dtype, as a mask or position table is built:
    Lightning's "bf16-true" makes that the parameters' dtype inside the step."""

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x * torch.ones(x.shape[-1]))))


class LeavesFloat64(SelfCall):
    """Sets torch's default dtype in its step and leaves it so."""

    def training_step(self, batch, batch_idx):
        torch.set_default_dtype(torch.float64)
        return super().training_step(batch, batch_idx)
