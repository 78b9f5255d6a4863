"""Which of a layer's activations Megatron's activation recompute drops until backward, and which
forward passes it runs again there, from a layout's ``Recompute`` (runtime/layout.py), as
Megatron's TransformerBlock and TransformerLayer read it:

* full: ``uniform`` checkpoints each model chunk's layers in groups of ``num_layers`` (a group
  keeps its input; backward runs the group's forward again, holding all of its layers'
  activations at once), ``block`` checkpoints the first ``num_layers`` of each chunk one by one
  and leaves the rest alone;
* selective, per module: ``layernorm`` (the norms' outputs, which nothing keeps until their
  gradient arrives), ``mlp`` (a dense MLP: Megatron's TransformerLayer leaves an MoE layer's
  alone), ``moe`` (an MoE layer's router, dispatch, experts and shared expert), ``shared_experts``
  (the shared expert alone) and ``core_attn`` (the core attention past Q, K and V). ``moe_act``
  and ``mla_up_proj`` are not modeled (``plan/args.py`` refuses them).
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
    """The selective modules the plan does not model."""
    return [module for module in modules if module not in MODELED_MODULES]
