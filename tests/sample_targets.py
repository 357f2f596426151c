"""Targets the tests' pytester sessions register, shared by the test modules that use the same one."""

# a correct softmax (exp and sum in float32, one rounding): passes every config of the softmax kind
CORRECT_SOFTMAX = """
@pytest_precision.register("mine", kind="softmax")
def mine(x):
    # fp32 arithmetic inside, as torch's and every fused kernel's softmax: the same formula in
    # bf16 arithmetic is 57 ULP off at scale 20 and the suite fails it
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
"""

# the same as a whole conftest
CORRECT_SOFTMAX_CONFTEST = """
import torch
import pytest_precision
""" + CORRECT_SOFTMAX

# the same softmax as a plain function (not registered), for sessions that wrap or plant it
SOFTMAX_FN = """
def softmax(x):
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
"""
