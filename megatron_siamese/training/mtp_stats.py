"""Each training step's multi-token prediction losses, as Megatron-LM reports them ("mtp_1 loss",
...): the mean over the step's microbatches and the data-parallel ranks of each MTP layer's masked
cross entropy, which megatron-core's GPTModel records in ``MTPLossLoggingHelper``'s tracker on
the last pipeline stage (0.16's ``values``, 0.19's ``loss_values``), in training forwards only. Reduced here with one
all-reduce over the whole job, every rank taking part (the last stage's TP rank 0 counts; the
tracker's own reduction runs over the pipeline group only where it holds values, which leaves
the other stages out).
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_siamese import device


def step_losses(mtp_num_layers: int, num_microbatches: int) -> Dict[str, float]:
    """The step's MTP losses by Megatron-LM's names, on every rank; the tracker cleared (a collective)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("values", tracker.get("loss_values"))
    local = torch.zeros(mtp_num_layers + 1, dtype=torch.float64, device=device.current())  # losses, then a count
    if values is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        local[:-1] = values.to(local.dtype)
        local[-1] = num_microbatches  # this DP rank's microbatches, each a mean over its tokens
    torch.distributed.all_reduce(local)
    if values is not None:
        values.zero_()
    if not local[-1]:
        return {}
    return {f"mtp_{layer + 1} loss": float(local[layer] / local[-1]) for layer in range(mtp_num_layers)}

