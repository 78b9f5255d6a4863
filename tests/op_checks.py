"""Checks shared by the fused ops' tests (test_kernels.py, test_boundary_ops.py)."""

import torch


def assert_compiles_like_eager(fn, streams):
    """``fn(streams)`` compiled with ``fullgraph=True`` (a graph break fails it) gives eager's
    output and eager's gradient of the streams."""
    eager = fn(streams)
    (grad_eager,) = torch.autograd.grad(eager.square().sum(), streams)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(streams)
    (grad_compiled,) = torch.autograd.grad(compiled.square().sum(), streams)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad_compiled, grad_eager)
