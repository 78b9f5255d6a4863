"""The final merge of the two streams: out = FinalNorm(NormX(x) + NormY(y))."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_siamese.norms import TorchNorm
from megatron_siamese.reference.functional import merge_streams
from megatron_siamese.streams import split_streams


class StreamMerge(MegatronModule):
    """X and Y streams ``[s, b, h]`` each -> ``NormX(x) + NormY(y)``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(config=config)
        self.hidden_size = hidden_size
        self.x_norm = TorchNorm(config=config, hidden_size=hidden_size, eps=eps)
        self.y_norm = TorchNorm(config=config, hidden_size=hidden_size, eps=eps)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return merge_streams(self.x_norm(x), self.y_norm(y))


class SiameseFinalNorm(TorchNorm):
    """The block's final norm for the Python block spec: merges the streams, then normalizes.

    Checkpoints store the stream norms (``merge.*``) as ``<stack>.layers.output_merge.*``, the name
    Megatron-LM's layer spec (whose last layer merges) gives them, so one checkpoint loads through either
    GPT entry point and, by Megatron's GPT-to-Hybrid translation, into a HybridModel stack.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config=config, hidden_size=hidden_size, eps=eps, **unused)
        self.merge = StreamMerge(config=config, hidden_size=hidden_size, eps=eps)

    def merged(self, packed: Tensor) -> Tensor:
        """Packed streams -> NormX(x) + NormY(y): the ``[s, b, h]`` stand-in for stock Megatron's residual."""
        return self.merge(*split_streams(packed, self.hidden_size))

    def forward(self, packed: Tensor) -> Tensor:
        return super().forward(self.merged(packed))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        stack = prefix[: prefix.rstrip(".").rfind(".") + 1]  # "decoder.final_layernorm." -> "decoder."
        apply_prefix_mapping(sharded, {f"{prefix}merge.": f"{stack}layers.output_merge."})
        return sharded
