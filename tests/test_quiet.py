"""Megatron's and torch's known notices are hidden, also by a handler that overrides ``filter``
(Megatron-LM's loop logs through one), and any other record still shows."""

import io
import logging

import pytest

from megatron_siamese.runtime.quiet import silence_known_notices


class OwnFilterHandler(logging.StreamHandler):
    """As Megatron-LM's ``log_handler.CustomHandler``: its own ``filter``, not calling the filters added to it."""

    def filter(self, record):
        return not record.name.startswith("torch.distributed")


@pytest.mark.stack_independent
@pytest.mark.parametrize("on_cpu_shim", [False, True])
def test_known_notices_are_hidden_and_others_shown(on_cpu_shim):
    stream = io.StringIO()
    handler = OwnFilterHandler(stream)
    megatron = logging.getLogger("megatron")
    megatron.addHandler(handler)
    try:
        silence_known_notices(on_cpu_shim=on_cpu_shim)
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is ...")
        logging.getLogger("megatron.core.tensor_parallel.random").warning("CPU RNG state changed within GPU RNG context")
        logging.getLogger("megatron.core.x").warning("something the run should show")
        logging.getLogger("torch.distributed.y").warning("the handler's own filter still applies")
    finally:
        megatron.removeHandler(handler)
        silence_known_notices()  # the process's guards as they were
    shown = stream.getvalue()
    assert "something the run should show" in shown and "GPTModel" not in shown and "own filter" not in shown
    assert ("CPU RNG state changed" in shown) is not on_cpu_shim  # hidden only where the CPU stands in for the GPU
