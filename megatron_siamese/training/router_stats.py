"""Each training step's router statistics of a mixture-of-experts model, the same on every rank.

- The auxiliary losses, as Megatron computes and tracks them: each router records its
  load-balancing loss (and z-loss) in megatron-core's MoE metrics tracker, and the step's
  values are what Megatron-LM's ``training_log`` reports: reduced across PP, the router's own
  group and DP, averaged over microbatches and MoE layers (``load_balancing_loss``,
  ``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``; 1.0 for the
  load-balancing loss is a perfectly balanced router).
- ``busiest_expert_load``: the tokens the busiest expert received relative to the mean per
  expert (1.0: balanced; at most experts / top-k), in the MoE layer where it is largest.
  Counted from each router's routing map over the step's training forwards (not evaluation,
  and a recomputed forward once: the first pass of Megatron's activation checkpointing runs
  without grad) and summed over every rank: the routers are replicated over TP, CP and DP
  (EP splits the experts, not the routing), each PP stage holds its own layers, and TP ranks
  without SP, which route the same tokens, scale every count alike and leave the ratio. The
  multi-token prediction layers' routers count as layers after the decoder's, as Megatron's
  tracker has them.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_siamese import device
from megatron_siamese.training.summary import BUSIEST

# Megatron-LM's names of the losses each load-balancing type tracks (training_log)
_LOAD_BALANCING = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


def tracked_losses(load_balancing_type: str, z_loss_coeff) -> List[str]:
    """The tracker's loss names a run reports, as Megatron-LM's training_log picks them."""
    names = [name for kind, name in _LOAD_BALANCING.items() if kind == load_balancing_type]
    return names + (["z_loss"] if z_loss_coeff is not None else [])


def moe_layers(config, settings) -> List[int]:
    """1 for each layer (Megatron's layer numbers) whose MLP is an MoE layer, else 0."""
    from megatron_siamese.hybrid_pattern import hybrid_pattern
    from megatron_siamese.support import moe_layer_pattern

    if settings.model == "hybrid":
        return [int(symbol == "E") for symbol in hybrid_pattern(settings).layers]
    return [int(moe) for moe in moe_layer_pattern(config)]


def _tracker_report(**options) -> dict:
    """Megatron's tracker: reduce, average, clear; the losses by name (megatron-core 0.19's
    MoEMetricsTracker, or 0.16's track_moe_metrics, which it deprecates)."""
    losses: Dict[str, torch.Tensor] = {}
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

        tracker = get_moe_layer_wise_logging_tracker()
        # a stage without MoE layers must size its entries as the routers do (multi-token prediction's
        # layers too), or the reduction over the pipeline hangs (0.16 sizes them num_layers; 0.19 fixed)
        size = options["num_layers"] + (options["mtp_num_layers"] or 0)
        for name in options["track_names"]:
            tracker.setdefault(name, {"values": torch.zeros(size, device=device.current()), "reduce_group": None,
                                      "avg_group": None, "reduce_group_has_dp": False})
        # 0.16 records each rank's z-loss of its own tokens without a group to reduce it over (the
        # number then depends on the layout); 0.19 averages it over TP x DP x CP: so here too
        z_loss = tracker.get("z_loss")
        if z_loss is not None and z_loss.get("reduce_group") is None and z_loss.get("avg_group") is None:
            z_loss["avg_group"] = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        track_moe_metrics(total_loss_dict=losses, **options)
    else:
        get_moe_metrics_tracker().report(total_loss_dict=losses, **options)
    return {name: float(value) for name, value in losses.items()}


def _in_order(losses: Dict[str, float], names: List[str]) -> Dict[str, float]:
    """The tracked losses in Megatron-LM's order (load balancing, then z-loss), then any other."""
    return {**{name: losses[name] for name in names if name in losses}, **losses}


def clear_tracker() -> None:
    """Forget what the routers recorded since the last step (Megatron-LM does after evaluating)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
    else:
        get_moe_metrics_tracker().clear()


class RouterStatistics:
    """Counts the routers of ``chunks`` (this rank's model chunks) as they route; ``step()``
    returns the step's statistics on every rank (a collective: every rank calls it)."""

    def __init__(self, chunks, config, settings):
        from megatron.core.transformer.moe.router import Router

        self.config, self.settings = config, settings
        self.layers = moe_layers(config, settings)
        self.names = tracked_losses(config.moe_router_load_balancing_type, config.moe_z_loss_coeff)
        # tokens per expert, by layer (Megatron's 1-based layer_number - 1: multi-token prediction's
        # layers after the decoder's), this step, this rank
        self.mtp_layers = config.mtp_num_layers or 0
        self.counts = torch.zeros(config.num_layers + self.mtp_layers, config.num_moe_experts, dtype=torch.float64,
                                  device=device.current())
        for module in (module for chunk in chunks for module in chunk.modules()):
            if isinstance(module, Router):
                module.register_forward_hook(self._count)

    def _count(self, router, inputs, output) -> None:
        if router.training and torch.is_grad_enabled():
            _, routing_map = output
            # 0.19 numbers a multi-token prediction layer's router from 1, flagged is_mtp_layer; 0.16 after the decoder's
            row = router.layer_number - 1 + (self.config.num_layers if getattr(router, "is_mtp_layer", False) else 0)
            self.counts[row] += routing_map.sum(dim=0).to(self.counts.dtype)

    def step(self, step: int, num_microbatches: int) -> Dict[str, float]:
        # force_initialize: a pipeline stage without MoE layers joins the reductions all the same
        losses = _tracker_report(loss_scale=1.0 / num_microbatches, iteration=step, force_initialize=True,
                                 track_names=self.names, num_layers=self.config.num_layers,
                                 moe_layer_freq=self.layers, mtp_num_layers=self.config.mtp_num_layers)
        stats = _in_order(losses, self.names)
        counts = self.counts.clone()
        self.counts.zero_()
        torch.distributed.all_reduce(counts)  # every layer's routing over all ranks
        # an MTP layer's MLP is the last decoder layer's kind (Megatron builds it from that layer's spec)
        moe = counts[[index for index, on in enumerate(self.layers + self.layers[-1:] * self.mtp_layers) if on]]
        moe = moe[moe.sum(dim=1) > 0]
        if len(moe):
            stats[BUSIEST] = float((moe.max(dim=1).values / moe.mean(dim=1)).max())
        return stats
