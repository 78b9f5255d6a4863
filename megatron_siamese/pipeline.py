"""Pipeline parallelism: stages exchange the packed ``[s, b, 2h]`` streams.

Megatron's schedules size pipeline receive buffers as ``[s, b, config.hidden_size]``.
Sending ``2h`` into an ``h`` buffer fails on gloo and corrupts or hangs on NCCL, so a
SiameseNorm model with PP > 1 needs one of:

* ``SiameseP2PCommunicator`` (fast path): a ``P2PCommunicator`` whose receive buffers are
  ``2h`` wide. Pass it to the schedule together with ``pg_collection``::

      forward_backward_func(..., p2p_communicator=SiameseP2PCommunicator(pp_group, config),
                            pg_collection=pg_collection)

* shape exchange (the safety net): when a SiameseNorm layer is built with PP > 1 it sets
  ``config.variable_seq_lengths = True`` on the shared config, so a schedule called without
  our communicator (Megatron-LM's ``pretrain_gpt.py``) exchanges tensor shapes before each
  transfer. That costs one small p2p and a device synchronize per transfer.
  ``SiameseP2PCommunicator`` undoes it when constructed (the caller has said it hands the
  schedule our communicator): the schedule then sizes fixed ``h`` buffers, which the
  communicator widens, with no exchange unless the user asked for variable sequence
  lengths themselves. (megatron-core >= 0.19 also passes empty shapes to the communicator
  while the flag is on, so leaving it on would break the fixed-shape path.)

Once it exists, hand the same communicator to every schedule call of that model (training
and evaluation alike): a call without it would receive ``2h`` into ``h``-wide buffers again.
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
