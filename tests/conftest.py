"""Shared fixtures. Multi-rank tests launch their own processes (megatron_siamese.runtime.launch);
single-rank tests run Megatron in this process on CPU through the CPU harness."""

import os
import sys

import pytest
import torch

# Set by scripts/test.sh: the stacks of this run, in order, and the one running now.
RUN_STACKS = os.environ.get("MEGATRON_SIAMESE_TEST_STACKS", "").split()
THIS_STACK = os.environ.get("MEGATRON_SIAMESE_TEST_STACK", "")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "stack_independent: exercises nothing that differs between megatron-core versions (argument "
        "parsing, help, signals, output); in a run over several stacks (scripts/test.sh) it runs on the first only")


def pytest_collection_modifyitems(config, items):
    if len(RUN_STACKS) < 2 or THIS_STACK == RUN_STACKS[0]:
        return
    skip = pytest.mark.skip(reason=f"stack-independent: ran on {RUN_STACKS[0]}, the first stack of this run")
    for item in items:
        if item.get_closest_marker("stack_independent"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_single_rank():
    """torch.distributed (gloo, world size 1) and Megatron's process groups at TP=PP=1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_siamese.runtime import cpu_shim
    from megatron_siamese.runtime.launch import free_port

    if not torch.cuda.is_available():
        cpu_shim.install()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(autouse=True)
def fresh_moe_state():
    """After each test, Megatron's process-wide MoE state, which a training loop sets up per run:
    the aux-loss gradient scale (a backward outside a schedule leaves it 0-d, and a schedule then
    fails to copy its [1] scale into it) and the per-layer router statistics (sized by the first
    model that records them)."""
    yield
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is None:
        return
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    moe_utils.clear_aux_losses_tracker()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # 0.16 only zeroes it, sized by its first model
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # megatron-core >= 0.19
    except ImportError:
        return
    destroy_moe_metrics_tracker()
