"""How the package's layers call Megatron's MLP sublayer (dense ``MLP`` or ``MoELayer``).

The SiameseNorm layer and the baselines override ``_forward_mlp``, dropping what the stock hook does
around the MLP call; this mixin puts it back for both:

* an MoE layer gets a packed (THD) batch as ``[s, b, h]`` per sample, so its per-sequence aux loss
  sees sequences (megatron-core >= 0.19's ``_maybe_unflatten_for_moe``);
* selective "mlp" recompute passes the output bias around the checkpoint: stock Megatron returns that
  bias Parameter from the checkpoint's Function, making it its own ``grad_fn``, and the backward
  recurses forever (0.16.1 with ``add_bias_linear``; docs/design.md).
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from megatron.core import tensor_parallel


class MLPCallMixin:
    """Needs ``self.mlp``, ``self.config``, ``self.recompute_mlp`` and ``self.pg_collection`` (a
    Megatron ``TransformerLayer``'s)."""

    def _call_mlp(self, normed: Tensor, padding_mask: Optional[Tensor] = None,
                  packed_seq_params=None) -> Tuple[Tensor, Optional[Tensor]]:
        """``(output, bias)`` of the MLP on its normalized input, as the stock hook calls it."""
        unflatten = getattr(self, "_maybe_unflatten_for_moe", None)  # megatron-core >= 0.19
        per_sample = None
        mask = padding_mask
        if unflatten is not None:
            normed, mask, per_sample = unflatten(normed, padding_mask, packed_seq_params)
        if self.recompute_mlp:
            output, bias = self._checkpointed_mlp(normed, mask)
        else:
            output, bias = self.mlp(normed, padding_mask=mask)
        if per_sample is not None:
            output = self._maybe_reflatten_from_moe(output, packed_seq_params, per_sample)
        return output, bias

    def _checkpointed_mlp(self, normed: Tensor, padding_mask: Optional[Tensor]):
        """Selective "mlp" recompute: only the activation crosses the checkpoint (see the module docstring)."""
        biases = []

        def mlp_activation(inp: Tensor) -> Tensor:
            output, bias = self.mlp(inp, padding_mask=padding_mask)
            if bias is not None and bias.grad_fn is not None:
                raise NotImplementedError(
                    "selective 'mlp' recompute needs the MLP's output bias to be a parameter"
                )
            biases[:] = [bias]
            return output

        if self.config.fp8 or getattr(self.config, "fp4", None):  # fp4: megatron-core >= 0.19
            from megatron.core.extensions.transformer_engine import te_checkpoint

            output = te_checkpoint(
                mlp_activation,
                False,
                tensor_parallel.random.get_cuda_rng_tracker,
                self.pg_collection.tp,
                normed,
            )
        else:
            output = tensor_parallel.checkpoint(mlp_activation, False, normed)
        return output, biases[0]
