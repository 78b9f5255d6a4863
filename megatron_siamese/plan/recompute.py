"""Which of a layer's activations Megatron's recompute drops until backward, and which forward passes it
runs again, from a layout's ``Recompute`` (runtime/layout.py), as TransformerBlock and TransformerLayer read it:

* full: ``uniform`` checkpoints a chunk's layers in groups of ``num_layers`` (backward reruns a group,
  holding all its layers' activations at once), ``block`` only the first ``num_layers``, one by one;
* selective, per module: ``mlp`` is a dense MLP only (TransformerLayer leaves an MoE layer's alone),
  ``moe`` an MoE layer's whole MLP, shared expert included; ``moe_act`` and ``mla_up_proj`` are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from megatron_siamese.runtime.layout import Recompute

MODELED_MODULES = ("layernorm", "mlp", "moe", "shared_experts", "core_attn")


@dataclass(frozen=True)
class LayerRecompute:
    """What one layer's backward brings back by running forward again."""

    whole: bool = False  # the whole layer (full recompute)
    norms: bool = False  # its norms' outputs
    core_attention: bool = False
    mlp: bool = False  # its MLP: a dense MLP, or an MoE layer's routed experts
    shared_expert: bool = False


def layer_recompute(recompute: Recompute, moe: bool, index_in_chunk: int) -> LayerRecompute:
    """What the ``index_in_chunk``-th layer of a model chunk recomputes (``moe``: an MoE layer)."""
    if recompute.full:
        return LayerRecompute(whole=recompute.method == "uniform" or index_in_chunk < recompute.num_layers)
    on = recompute.recomputes
    return LayerRecompute(norms=on("layernorm"), core_attention=on("core_attn"),
                          mlp=on("moe") if moe else on("mlp"),
                          shared_expert=moe and (on("moe") or on("shared_experts")))


def checkpointed_groups(recompute: Recompute, layers: int) -> List[Tuple[int, ...]]:
    """The indices of a chunk's ``layers`` that full recompute checkpoints together, each group from
    its first layer's input (none without full recompute)."""
    if not recompute.full:
        return []
    if recompute.method == "block":
        return [(index,) for index in range(min(recompute.num_layers, layers))]
    return [tuple(range(start, min(start + recompute.num_layers, layers)))
            for start in range(0, layers, recompute.num_layers)]


def unmodeled_modules(modules: Sequence[str]) -> List[str]:
    return [module for module in modules if module not in MODELED_MODULES]
