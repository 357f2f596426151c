"""Two tiny Triton kernels that show whether this process's Triton interpreter has the bfloat16
defects known in triton 3.9.0 (imported only under the interpreter, by ``kinds.triton``)."""
import triton
import triton.language as tl

__all__ = ["store_bf16", "dot_bf16"]


@triton.jit
def store_bf16(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))


@triton.jit
def dot_bf16(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))
