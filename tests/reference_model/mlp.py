"""The reference's dense MLP: the GPT's MLP sublayer, and each expert and the shared expert of
its mixture-of-experts sublayer (tests/reference_model/moe.py). Megatron's layout: a gated MLP splits
``linear_fc1`` into [gate, up] halves; ``linear_fc2``'s bias is kept apart (``fc2_bias``), as
Megatron returns it for the bias-dropout-add."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


class ReferenceMLP(nn.Module):
    def __init__(self, config, ffn_hidden_size: Optional[int] = None):
        """``config``: a ReferenceGPTConfig; ``ffn_hidden_size`` overrides its width (experts)."""
        super().__init__()
        self.config = config
        width = ffn_hidden_size or config.ffn_hidden_size
        fc1_out = width * (2 if config.gated_linear_unit else 1)
        self.linear_fc1 = nn.Linear(config.hidden_size, fc1_out, bias=config.add_bias_linear)
        self.linear_fc2 = nn.Linear(width, config.hidden_size, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(config.hidden_size)) if config.add_bias_linear else None

    def forward(self, x):
        """x [..., h] -> (output without the fc2 bias, the fc2 bias)."""
        act = ACTIVATIONS[self.config.activation]
        hidden = self.linear_fc1(x)
        if self.config.gated_linear_unit:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = act(gate) * up
        else:
            hidden = act(hidden)
        return self.linear_fc2(hidden), self.fc2_bias
