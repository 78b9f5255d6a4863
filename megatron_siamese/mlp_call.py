"""How the package's layers call Megatron's MLP sublayer (dense ``MLP`` or ``MoELayer``).

Both the SiameseNorm layer and the single-stream baselines override ``TransformerLayer``'s
``_forward_mlp``, which drops what the stock hook does around the MLP call itself; this mixin
puts it back once, for both:

* an MoE layer gets a flattened packed (THD) batch back as ``[s, b, h]`` per sample, so that its
  per-sequence aux loss sees sequences (megatron-core >= 0.19's ``_maybe_unflatten_for_moe``);
* selective "mlp" recompute checkpoints the MLP, passing its output bias around the checkpoint
  (``_checkpointed_mlp``): stock Megatron returns that bias Parameter from the checkpoint's
  autograd Function, which makes the Parameter its own ``grad_fn`` and recurses forever in the
  backward (0.16.1 with ``add_bias_linear``).
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
        """Selective "mlp" recompute: only the activation crosses the checkpoint, the bias (a
        Parameter, ``linear_fc2`` with ``skip_bias_add``) is used directly."""
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
