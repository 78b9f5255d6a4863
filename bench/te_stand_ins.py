"""Transformer Engine's module structure, stood in for by Megatron's local modules, on CPU.

Megatron's TE layer spec fuses each sublayer's InputNorm into its first linear
(``TELayerNormColumnParallelLinear``; ``input_layernorm`` / ``pre_mlp_layernorm`` empty) and
uses TE's norm for QK-norm. ``stood_in()`` makes Megatron build that structure from local
modules (a LayerNorm-fused linear = ``TorchNorm`` + ``ColumnParallelLinear`` under TE's
parameter names; TE's plain linear = ``ColumnParallelLinear``), so the TE specs build and run
on CPU: what that checks is how the specs wire TE's modules and name their weights, and which
passes their op structure makes (bench/sublayer_bytes.py), not TE's numerics (bench/gpu/).

Used by tests/test_transformer_engine.py and bench/sublayer_bytes.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_siamese import te
from megatron_siamese.norms import TorchNorm
from megatron_siamese.specs import _with_fc1


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """Stands in for TE's ``TELayerNormColumnParallelLinear``: the InputNorm, its parameters under
    TE's names (``layer_norm_weight`` / ``layer_norm_bias``), then the column-parallel GEMM.
    ``norm_region``: a context manager the norm runs in (bench/sublayer_bytes.py counts its bytes)."""

    norm_region = staticmethod(lambda function, inp: function(inp))

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        norm = TorchNorm(config, input_size, eps=config.layernorm_epsilon)
        object.__setattr__(self, "input_norm", norm)  # its parameters are registered here, renamed:
        self.layer_norm_weight = norm.weight
        self.layer_norm_bias = norm.bias

    def forward(self, input_, *args, **kwargs):
        return super().forward(type(self).norm_region(self.input_norm, input_), *args, **kwargs)


def te_shaped_layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, **_unused):
    """Megatron's TE GPT layer spec's shape (dense layers), built of local modules."""
    assert num_experts is None, "the stand-ins are for dense layers"
    stock = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm).submodules
    qk_norm = TorchNorm if qk_layernorm else IdentityOp
    attention = dataclasses.replace(stock.self_attention, submodules=dataclasses.replace(
        stock.self_attention.submodules, linear_qkv=LayerNormColumnParallelLinear, q_layernorm=qk_norm,
        k_layernorm=qk_norm))
    return ModuleSpec(module=TransformerLayer, submodules=dataclasses.replace(
        stock, input_layernorm=IdentityOp, self_attention=attention, pre_mlp_layernorm=IdentityOp,
        mlp=_with_fc1(stock.mlp, LayerNormColumnParallelLinear), sharded_state_dict_keys_map={}))


@contextlib.contextmanager
def stood_in(plain_linear=ColumnParallelLinear):
    """Within: Megatron's TE layer spec builds ``te_shaped_layer_spec``, TE's plain linear is
    ``plain_linear``, ``TENorm`` is ``TorchNorm``, and the package sees Transformer Engine as
    available. Yields Megatron's TE extension module (its names patched)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.gpt import gpt_layer_specs

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                                              te_shaped_layer_spec))
        stack.enter_context(mock.patch.object(gpt_layer_specs, "TENorm", TorchNorm, create=True))
        stack.enter_context(mock.patch.object(te_extension, "TEColumnParallelLinear", plain_linear))
        stack.enter_context(mock.patch.object(te_extension, "TENorm", TorchNorm))
        stack.enter_context(mock.patch.object(te, "unavailable_reason", lambda: None))
        yield te_extension
