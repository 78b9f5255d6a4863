"""Pipeline parallelism: stages exchange the packed ``[s, b, 2h]`` streams.

Megatron sizes receive buffers ``h`` wide; ``2h`` into them fails on gloo and corrupts or hangs on NCCL. Fast path:
``SiameseP2PCommunicator`` (``2h`` buffers), passed to every schedule call of the model with ``pg_collection``.
Safety net: a layer built with PP > 1 turns on ``config.variable_seq_lengths`` (shape exchange per transfer); the
communicator restores the user's setting, since megatron-core >= 0.19 passes it empty shapes while the flag is on.
docs/design.md, "Pipeline parallelism".
"""

from __future__ import annotations

import logging

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

# Set on the shared config object by the first SiameseNorm layer built with PP > 1.
_USER_VARIABLE_SEQ_LENGTHS = "_siamese_user_variable_seq_lengths"


def require_wide_pipeline_tensors(config: TransformerConfig) -> None:
    """Make Megatron's default p2p path exchange shapes, so 2h tensors are received whole."""
    if config.pipeline_model_parallel_size <= 1 or hasattr(config, _USER_VARIABLE_SEQ_LENGTHS):
        return
    setattr(config, _USER_VARIABLE_SEQ_LENGTHS, config.variable_seq_lengths)
    if not config.variable_seq_lengths:
        logger.info(
            "SiameseNorm: PP>1 sends [s, b, 2h] between stages; enabling "
            "config.variable_seq_lengths so Megatron's schedules exchange shapes. Pass "
            "p2p_communicator=SiameseP2PCommunicator(pp_group, config) to skip that exchange."
        )
        config.variable_seq_lengths = True


class SiameseP2PCommunicator(P2PCommunicator):
    """A ``P2PCommunicator`` whose 3-D hidden-state buffers are ``2 * hidden_size`` wide."""

    def __init__(self, pp_group, config: TransformerConfig):
        if hasattr(config, _USER_VARIABLE_SEQ_LENGTHS):  # the layers' safety net: no longer needed
            config.variable_seq_lengths = getattr(config, _USER_VARIABLE_SEQ_LENGTHS)
        super().__init__(pp_group, config)
        self.hidden_size = config.hidden_size

    def _communicate(self, *, tensor_shape=None, **kwargs):
        if tensor_shape is not None and len(tensor_shape) == 3 and tensor_shape[-1] == self.hidden_size:
            tensor_shape = (tensor_shape[0], tensor_shape[1], 2 * self.hidden_size)
        return super()._communicate(tensor_shape=tensor_shape, **kwargs)
