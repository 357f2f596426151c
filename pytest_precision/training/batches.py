"""A step's batch: split along dim 0 into equal micro-batches (the standard step's accumulation,
``spec.standard_step``, and its verdict, ``accumulation``, split it the same way), and its digest
(a run records each step's, so a config that saw other data is told apart)."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

__all__ = ["split_batch", "batch_sizes", "map_tensors", "data_digest", "MicroBatches"]


class MicroBatches(list):
    """A step's micro-batches as a loop that accumulates takes them (a Trainer's): split along the
    list, not inside its batches (where the list does not divide, each micro-batch is split)."""


def batch_sizes(batch: Any) -> set[int]:
    """The dim-0 sizes of the tensors in ``batch`` (0-dim tensors and other values have none)."""
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() else set()
    if isinstance(batch, dict):
        return set().union(*(batch_sizes(v) for v in batch.values())) if batch else set()
    if isinstance(batch, (tuple, list)):
        return set().union(*(batch_sizes(v) for v in batch)) if batch else set()
    return set()


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) with ``fn`` applied to each tensor;
    other values kept as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(fn, v) for key, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def _part(batch: Any, k: int, size: int) -> Any:
    return map_tensors(lambda t: t[k * size:(k + 1) * size] if t.dim() else t, batch)


def split_batch(batch: Any, n: int) -> list[Any]:
    """``batch`` (a tensor, or tuples, lists and dicts of them) as ``n`` micro-batches of equal size
    along dim 0; other values are passed to every micro-batch as they are."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"accumulate must be a positive int, got {n!r}")
    if isinstance(batch, MicroBatches):
        if len(batch) % n == 0:
            size = len(batch) // n
            return [MicroBatches(batch[k * size:(k + 1) * size]) for k in range(n)]
        # fewer micro-batches than shares (the FSDP2 ranks' of one micro-batch): each split inside
        return [MicroBatches(parts) for parts in zip(*(split_batch(mb, n) for mb in batch))]
    sizes = batch_sizes(batch)
    if len(sizes) != 1:
        raise ValueError(f"accumulate={n}: the batch's tensors must share their dim-0 size to be split into "
                         f"micro-batches, got sizes {sorted(sizes) or 'none'}")
    size = sizes.pop()
    if size % n:
        raise ValueError(f"accumulate={n}: the batch's dim-0 size {size} is not a multiple of {n}; micro-batches of "
                         "equal size keep the mean of their losses the whole batch's mean loss")
    return [_part(batch, k, size // n) for k in range(n)]


def data_digest(obj: Any) -> str:
    """sha256 of a batch (tensors' dtype, shape and bytes, through tuples, lists and dicts; other
    values by repr): equal digests, equal data."""
    h = hashlib.sha256()

    def feed(o):
        if isinstance(o, torch.Tensor):
            a = o.detach().cpu().contiguous()
            h.update(f"T{a.dtype}{tuple(a.shape)}".encode())
            h.update(a.view(torch.uint8).numpy().tobytes() if a.numel() else b"")
        elif isinstance(o, dict):
            h.update(f"D{len(o)}".encode())
            for k in o:
                h.update(repr(k).encode())
                feed(o[k])
        elif isinstance(o, (tuple, list)):
            h.update(f"L{len(o)}".encode())
            for v in o:
                feed(v)
        else:
            h.update(f"V{o!r}".encode())
    feed(obj)
    return h.hexdigest()
