"""bfloat16 under Triton's interpreter, computed as a GPU computes it.

Triton's interpreter (triton 3.9) keeps bfloat16 values as their raw bits in numpy ``uint16``
arrays and hands those bits to numpy as if they were integers: ``1.5 * 2.0`` gives 0,
comparisons and min/max are wrong for negatives, ``-x`` wraps, ``tl.sum`` adds the bit patterns,
``tl.dot`` multiplies them, and fp32 -> bf16 casts truncate (and garble subnormals) instead of
rounding to nearest even. Within :func:`emulate_bf16` the interpreter's builder (the one module-level
``interpreter_builder`` every interpreted kernel goes through) and its reduction and scan helpers
compute bf16 as a GPU does instead:

- float ops with bf16 operands widen them exactly to fp32 (``bits << 16``), compute as the
  interpreter computes fp32, and round a bf16 result to nearest even (torch's conversion, which
  gets subnormals and NaN right). For + - * / and sqrt, rounding the fp32 result again is the
  correctly rounded bf16 result (fp32's 24 bits are at least 2 x 8 + 2: double rounding is
  innocuous), which is also what torch's CPU bf16 ops and a GPU give; an fma rounds twice here
  (fp32, then bf16), a native bf16 fma once: they differ only where the fp32 result lies exactly
  halfway between two bf16 values. Comparisons compare the widened values;
- casts to bf16 round to nearest even (toward zero where the kernel asked
  ``fp_downcast_rounding="rtz"``), from fp16, fp64 and integers through fp32 as torch does; casts
  from bf16 are exact;
- ``tl.dot`` of bf16 operands multiplies the widened operands in fp32 and accumulates in the
  accumulator's dtype, as tensor cores do (the products are exact in fp32);
- ``tl.sum`` / ``tl.cumsum`` / ``tl.cumprod`` of bf16 round to bf16 at every addition (a GPU
  does too, in another order: each thread adds its elements, then lanes and warps combine in a
  tree; here a pairwise tree, or for scans a Hillis-Steele scan, rounded per level), and fp16 sums
  round to fp16 at every addition too (numpy accumulates fp16 sums in fp32, so a 16-bit sum would
  look better on a CPU than on a GPU); min/max/argmin/argmax compare the widened values;
- pure bit moves (loads, stores, splat, broadcast, reshape, where, bitcast, abs, cat, join,
  trans, gather) stay as they are: they are right on the bits.

Any other builder op that meets a bf16 operand (atomics, extern/libdevice functions, inline asm,
histogram, ``tl.dot_scaled``, and whatever a later triton adds) runs as the interpreter has it and
is noted on the running launch (``launches.Launch.unemulated``); a failing case that ran one
is not the kernel's fault. Each emulated op notes its class on the launch (``Launch.bf16_ops``), so
a defect the canary still sees under the emulation is cited only where the launch computed it.

Import this module only where triton is imported in interpreter mode (``triton`` does).

Measured (triton 3.9.0, a 2-core CPU): each interpreted builder op that meets no bf16 pays 0.1 to 0.7
us for the check (the interpreter's own op takes 2.5 to 14 us), and entering and leaving the emulation
about 60 us a call. The built-in kernels' cases (``TRITON_INTERPRET=1 pytest --precision-suite -m
precision -k triton --precision-no-speed``, 210 cases, which compute no bf16 themselves) took 116 to
210 s without it and 147 to 253 s with it, in four interleaved runs each on 2 shared cores (median CPU
time 107 and 111 s). Under it the Triton tutorials' fused softmax passes in bf16 (it was xfailed
before); a planted ``x - max`` in the logits' dtype (``tests/test_interpreter.py``) is right in fp32,
0.49 ULP in fp16 at logits of scale 20, and fails bf16 at 56.56 ULP; a running sum kept in bf16
fails at 18 ULP on rows of 32768.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _interpreter
from triton.runtime.interpreter import ReduceOps, ScanOps, TensorHandle

from .launches import current_launch

__all__ = ["emulate_bf16", "emulating", "ARITHMETIC", "COMPARISON", "CAST", "DOT", "SUM", "round_to_bf16"]

# the classes of bf16 ops the emulation computes, as noted on a launch (and as the canary names defects)
ARITHMETIC, COMPARISON, CAST, DOT, SUM = "arithmetic", "comparison", "cast", "dot", "sum"

_BITS = np.dtype(np.uint16)  # how the interpreter stores a bf16 value

# builder ops that compute a bf16 result from bf16 operands (the interpreter's fp32 op on widened ones)
_ARITHMETIC_OPS = (
    "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem", "create_precise_divf",
    "create_approx_divf", "create_fneg", "create_fma", "create_exp", "create_exp2", "create_log", "create_log2",
    "create_sqrt", "create_precise_sqrt", "create_rsqrt", "create_sin", "create_cos", "create_erf", "create_floor",
    "create_ceil")
_MIN_MAX_OPS = ("create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf", "create_clampf")
_COMPARISON_OPS = tuple(f"create_fcmp{p}" for p in ("OLT", "OGT", "OLE", "OGE", "OEQ", "ONE",
                                                    "ULT", "UGT", "ULE", "UGE", "UEQ", "UNE"))
# builder ops left alone: they move bits (right for bf16 as they are) or never take a float
_UNTOUCHED = frozenset({
    # bit moves
    "create_load", "create_store", "create_masked_load", "create_masked_store", "create_splat", "create_unsplat",
    "create_broadcast", "create_reshape", "create_expand_dims", "create_select", "create_bitcast", "create_fabs",
    "create_cat", "create_join", "create_split", "create_trans", "create_gather", "create_make_tensor_descriptor",
    "create_descriptor_load", "create_descriptor_store", "create_descriptor_gather", "create_descriptor_scatter",
    "create_atomic_load", "create_atomic_store",
    # compare-and-swap and polling compare bit patterns, as a GPU's 16-bit atom.cas does
    "create_atomic_cas", "create_atomic_poll",
    # integers, pointers, the grid, and ops with no numeric result
    "create_add", "create_sub", "create_mul", "create_and", "create_or", "create_xor", "create_shl", "create_lshr",
    "create_ashr", "create_idiv", "create_sdiv", "create_udiv", "create_srem", "create_urem", "create_iabs",
    "create_umulhi", "create_minsi", "create_minui", "create_maxsi", "create_maxui",
    "create_icmpEQ", "create_icmpNE", "create_icmpSGE", "create_icmpSGT", "create_icmpSLE", "create_icmpSLT",
    "create_icmpUGE", "create_icmpUGT", "create_icmpULE", "create_icmpULT",
    "create_addptr", "create_int_to_ptr", "create_ptr_to_int", "create_make_range", "create_get_program_id",
    "create_get_num_programs", "create_assert", "create_assume", "create_barrier", "create_print",
    # casts: every one goes through cast_impl, emulated below
    "create_fp_ext", "create_fp_trunc", "create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui",
    "create_int_cast",
})
# what a user wrote, for the builder ops a note may name
_OP_NAMES = {"create_extern_elementwise": "an extern (libdevice) function", "create_inline_asm": "tl.inline_asm_elementwise",
             "create_histogram": "tl.histogram", "create_dot_scaled": "tl.dot_scaled"}


# ---- values -------------------------------------------------------------------------------------

def _is_bf16(value) -> bool:
    """A handle holding bf16 bits (comparison results keep their operands' dtype with bool data).
    Names are compared rather than dtypes: every builder call asks, and ``tl.dtype.__eq__`` is slower."""
    return isinstance(value, TensorHandle) and value.data.dtype == _BITS and value.dtype.name == "bf16"


def _widened(bits: np.ndarray) -> np.ndarray:
    """bf16 bits as the fp32 values they are (exact: bf16 is fp32's upper half)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """Float values rounded to nearest even bf16, as bits (torch's conversion: subnormals, inf and
    NaN right). float64 and integers go through fp32 first, as torch converts them."""
    with np.errstate(over="ignore", invalid="ignore"):  # fp64 beyond fp32's range becomes inf, as intended
        values = np.require(values, np.float32, ["C", "W"])
    # out of sight of torch's modes: the tracer and the audit watch the user's ops, and this is the
    # interpreter's arithmetic (as its numpy is), not a cast in the user's code
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(_BITS)


def _toward_zero_bf16(values: np.ndarray) -> np.ndarray:
    """Float values rounded toward zero to bf16, as bits (``fp_downcast_rounding="rtz"``)."""
    values = np.asarray(values)
    if values.dtype != np.float32:  # to fp32 toward zero first: truncating twice is truncating once
        with np.errstate(over="ignore", invalid="ignore"):
            narrow = values.astype(np.float32)
        over = np.abs(narrow.astype(np.float64)) > np.abs(values.astype(np.float64))
        values = np.where(over, np.nextafter(narrow, np.float32(0)), narrow)
    bits = (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(_BITS).reshape(values.shape)
    nan = np.isnan(values)
    return np.where(nan, round_to_bf16(values), bits).astype(_BITS) if nan.any() else bits


def _bf16_values(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16, kept as fp32 (for arithmetic that goes on)."""
    return _widened(round_to_bf16(values))


def _widen(handle):
    return TensorHandle(_widened(handle.data), tl.float32) if _is_bf16(handle) else handle


def _narrow(handle) -> TensorHandle:
    return TensorHandle(round_to_bf16(handle.data), tl.bfloat16)


def _note(ops: str) -> None:
    launch = current_launch()
    if launch is not None:
        launch.bf16_ops.add(ops)


# ---- builder ops --------------------------------------------------------------------------------

def _computed(original: Callable, ops: str) -> Callable:
    """An arithmetic or min/max op (class ``ops``): on widened operands, its bf16 result rounded."""
    def op(*args):
        for a in args:
            if _is_bf16(a):
                _note(ops)
                return _narrow(original(*(_widen(a) for a in args)))
        return original(*args)
    return op


def _compared(original: Callable) -> Callable:
    """A comparison: on widened operands; the result handle typed as the interpreter types it."""
    def op(lhs, rhs):
        if not (_is_bf16(lhs) or _is_bf16(rhs)):
            return original(lhs, rhs)
        _note(COMPARISON)
        return TensorHandle(original(_widen(lhs), _widen(rhs)).data, lhs.dtype)
    return op


def _cast(original: Callable) -> Callable:
    """``cast_impl``, which every plain cast goes through (fp ext/trunc, int <-> float)."""
    def cast_impl(src, dst_type):
        if not (dst_type.scalar.name == "bf16" or _is_bf16(src)):
            return original(src, dst_type)
        _note(CAST)
        if _is_bf16(src):
            wide = _widen(src)
            return wide if dst_type.scalar == tl.float32 else original(wide, dst_type)
        return TensorHandle(round_to_bf16(src.data), tl.bfloat16)
    return cast_impl


def _fp_to_fp(original: Callable, original_cast: Callable) -> Callable:
    """``create_fp_to_fp``: fp16 <-> bf16, fp8 <-> bf16 and casts with an explicit rounding mode."""
    toward_zero = _interpreter._ir.ROUNDING_MODE.RTZ

    def create_fp_to_fp(src, dst_type, rounding_mode):
        dst = dst_type.scalar
        if _is_bf16(src):
            _note(CAST)
            wide = _widen(src)
            if dst == tl.float32:
                return wide
            if dst in (tl.float16, tl.float64):
                return original_cast(wide, dst_type)  # numpy's astype: round to nearest even, exact upward
            return original(wide, dst_type, rounding_mode)  # to fp8, as the interpreter converts fp32
        if dst != tl.bfloat16:
            return original(src, dst_type, rounding_mode)
        _note(CAST)
        values = src.data
        if src.dtype.scalar.is_fp8():  # decoded as the interpreter decodes fp8; every fp8 value is a bf16 value
            values = original(src, tl.float32, None).data
        if rounding_mode == toward_zero:
            return TensorHandle(_toward_zero_bf16(values), tl.bfloat16)
        return TensorHandle(round_to_bf16(values), tl.bfloat16)
    return create_fp_to_fp


def _dot(original: Callable) -> Callable:
    def create_dot(a, b, d, input_precision, max_num_imprecise_acc):
        if not (_is_bf16(a) or _is_bf16(b)):
            return original(a, b, d, input_precision, max_num_imprecise_acc)
        _note(DOT)  # products of bf16 values are exact in fp32; the sum accumulates in d's dtype
        return original(_widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)
    return create_dot


def _holds_bf16(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_is_bf16(v) for v in value)
    return _is_bf16(value)


def _op_name(name: str, args: tuple) -> str:
    if name == "create_atomic_rmw" and args:
        op = getattr(args[0], "name", str(args[0])).lower()
        return "tl.atomic_" + (op[1:] if op in ("fadd", "umin", "umax") else op)
    if name == "create_extern_elementwise" and len(args) > 2:
        return f"the extern (libdevice) function {args[2]}"
    return _OP_NAMES.get(name, name.removeprefix("create_"))


def _noted(name: str, original: Callable) -> Callable:
    """An op the emulation does not cover: run as it is, noted on the launch where it met bf16."""
    def op(*args, **kwargs):
        if any(_holds_bf16(a) for a in args) or any(_holds_bf16(v) for v in kwargs.values()):
            launch = current_launch()
            if launch is not None:
                launch.unemulated.add(_op_name(name, args))
        return original(*args, **kwargs)
    return op


def _builder_patches(builder) -> dict[str, Callable]:
    """Every builder method the emulation replaces, by name, with its replacement."""
    patches: dict[str, Callable] = {}
    for names, ops in ((_ARITHMETIC_OPS, ARITHMETIC), (_MIN_MAX_OPS, COMPARISON)):
        for name in names:
            if hasattr(builder, name):
                patches[name] = _computed(getattr(builder, name), ops)
    for name in _COMPARISON_OPS:
        if hasattr(builder, name):
            patches[name] = _compared(getattr(builder, name))
    patches["cast_impl"] = _cast(builder.cast_impl)
    patches["create_fp_to_fp"] = _fp_to_fp(builder.create_fp_to_fp, builder.cast_impl)
    patches["create_dot"] = _dot(builder.create_dot)
    for name in dir(type(builder)):
        if name.startswith("create_") and name not in patches and name not in _UNTOUCHED:
            patches[name] = _noted(name, getattr(builder, name))
    return patches


# ---- reductions and scans -----------------------------------------------------------------------

def _pairwise(values: np.ndarray, rounded: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The sum over axis 0 of ``values``, as a tree of pairwise additions, each level ``rounded``."""
    if values.shape[0] == 0:
        return np.zeros(values.shape[1:], values.dtype)
    while values.shape[0] > 1:
        half = values.shape[0] // 2
        level = rounded(values[:half] + values[half:2 * half])
        values = np.concatenate([level, values[2 * half:]]) if values.shape[0] % 2 else level
    return values[0]


def _reduced_sum(self, data: np.ndarray, rounded: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``data`` summed as ``ReduceOps.sum`` sums it (its axis, keep_dims), rounded per addition."""
    axis = self.axis
    flat = data.reshape(-1) if axis is None else np.moveaxis(data, axis, 0)
    total = np.asarray(_pairwise(flat, rounded))
    if self.keep_dims:
        total = total.reshape((1,) * data.ndim) if axis is None else np.expand_dims(total, axis)
    return total


def _sum(original: Callable) -> Callable:
    def sum(self, input):
        if input.dtype == tl.bfloat16:
            _note(SUM)
            total = _reduced_sum(self, _widened(input.handle.data), _bf16_values)
            return self.to_tensor(round_to_bf16(total), input.dtype)
        if input.dtype == tl.float16:  # numpy's fp16 add rounds each result to fp16
            return self.to_tensor(_reduced_sum(self, input.handle.data, lambda v: v), input.dtype)
        return original(self, input)
    return sum


def _retyped(type, scalar):
    return type.with_element_ty(scalar) if type.is_block() else scalar


def _min_max(original: Callable) -> Callable:
    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        tensor = input[0] if isinstance(input, tuple) else input
        if tensor.dtype != tl.bfloat16:
            return original(self, input, val_reduce_op, idx_reduce_op)
        _note(COMPARISON)
        wide = tl.core.tensor(TensorHandle(_widened(tensor.handle.data), tl.float32), _retyped(tensor.type, tl.float32))
        result = original(self, wide, val_reduce_op, idx_reduce_op)
        if val_reduce_op is None:  # indices only
            return result
        value, rest = (result[0], result[1:]) if idx_reduce_op is not None else (result, ())
        value = tl.core.tensor(TensorHandle(round_to_bf16(value.handle.data), tl.bfloat16),
                               _retyped(value.type, tl.bfloat16))  # exact: a min or max is one of the values
        return (value, *rest) if rest else value
    return min_max


def _rounded_scan(values: np.ndarray, axis: int, combine: Callable) -> np.ndarray:
    """An inclusive scan along ``axis`` as a Hillis-Steele scan, each step rounded to bf16."""
    x = np.moveaxis(values, axis, 0)
    step = 1
    while step < x.shape[0]:
        x = np.concatenate([x[:step], _bf16_values(combine(x[step:], x[:-step]))])
        step *= 2
    return np.moveaxis(x, 0, axis)


def _scan(original: Callable, combine: Callable) -> Callable:
    def scan(self, input):
        if input.dtype != tl.bfloat16:
            return original(self, input)
        _note(SUM)
        values = _rounded_scan(_widened(input.handle.data), self.axis, combine)
        return [self.to_tensor(round_to_bf16(values), input.dtype)]
    return scan


# ---- the scope ----------------------------------------------------------------------------------

_LOCK = threading.Lock()
_depth = 0
_undo: list[tuple[object, str, object]] = []
_ABSENT = object()


def _set(obj, name: str, value) -> None:
    _undo.append((obj, name, vars(obj).get(name, _ABSENT)))
    setattr(obj, name, value)


def _restore() -> None:
    while _undo:
        obj, name, previous = _undo.pop()
        if previous is _ABSENT:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)


def _install() -> None:
    try:
        builder = _interpreter.interpreter_builder
        for name, op in _builder_patches(builder).items():
            _set(builder, name, op)
        _set(ReduceOps, "sum", _sum(ReduceOps.sum))
        _set(ReduceOps, "min_max", _min_max(ReduceOps.min_max))
        _set(ScanOps, "cumsum", _scan(ScanOps.cumsum, np.add))
        _set(ScanOps, "cumprod", _scan(ScanOps.cumprod, np.multiply))
    except BaseException:
        _restore()
        raise


@contextlib.contextmanager
def emulate_bf16() -> Iterator[None]:
    """Within the block, interpreted Triton code computes bfloat16 as a GPU does (module doc).
    Re-entrant: the interpreter is patched on the outermost entry and restored on its exit, also
    on error. Process-wide while active (the interpreter's builder is one object)."""
    global _depth
    with _LOCK:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                _restore()


def emulating() -> bool:
    """Whether the emulation is active now."""
    return _depth > 0
