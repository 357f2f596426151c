"""Targets the tests' pytester sessions register, shared by the test modules that use the same one."""

# a correct softmax (exp and sum in float32, one rounding): passes every config of the softmax kind
CORRECT_SOFTMAX_CONFTEST = """
import torch
import pytest_precision

@pytest_precision.register("mine", kind="softmax")
def mine(x):
    xf = x.float()
    e = (xf - xf.amax(-1, keepdim=True)).exp()
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)
"""
