"""The bytes one GPU sends per training step, by kind of parallelism.

Each collective is booked by the ring rule (``sent_bytes``; bench/collective_counter.py measures by it too): an
all-reduce of N bytes over g ranks sends ``2 (g-1)/g N`` per rank, an all-gather, reduce-scatter or all-to-all
``(g-1)/g N``, a send N. The counts per kind are in the code; besides: a sublayer whose forward runs again
in backward (``recompute.py``) repeats its forward collectives; PP sends ``[Ts, b, 2h]`` SiameseNorm streams
(``[Ts, b, h]`` stock); SiameseNorm's four stream norms a layer join the once-a-step TP sum of norm gradients;
EP books Megatron's alltoall dispatcher under a balanced router; CP only the local attention's K/V all-gathers
(Transformer Engine's exchange is its own, the same for stock). docs/scale.md, "Where SiameseNorm adds".
"""

from __future__ import annotations

from typing import Dict, List

from megatron_siamese.plan.activations import STAT, STOCK, Tokens
from megatron_siamese.plan.placement import Chunk
from megatron_siamese.plan.recompute import layer_recompute
from megatron_siamese.plan.shapes import Parameter, Shape
from megatron_siamese.plan.states import DataParallelSharding, dense_dp_size, expert_dp_size
from megatron_siamese.runtime.layout import Layout

KINDS = ("tp", "sp", "pp", "dp", "ep", "cp")
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, ALL_TO_ALL, SEND, RECV = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")
# a TP-split sublayer's collectives per microbatch: without SP the output projection's all-reduce
# forward and the input projection's backward; with SP an all-gather before the input projection
# forward, of the output gradient and of the input again (for the weight gradient) backward, and
# a reduce-scatter after the output projection forward and of the input gradient backward
SUBLAYER_COLLECTIVES = {ALL_REDUCE: 2, ALL_GATHER: 3, REDUCE_SCATTER: 2}


def sent_bytes(op: str, payload: float, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on a payload of ``payload`` bytes over ``group_size`` ranks
    (the rule in the module docstring; bench/collective_counter.py measures by it too)."""
    if op == SEND:
        return float(payload)
    if group_size <= 1 or op == RECV:
        return 0.0
    share = (group_size - 1) / group_size
    return (2 * share if op == ALL_REDUCE else share) * payload


class Traffic:
    """Bytes sent, booked by kind."""

    def __init__(self):
        self.sent: Dict[str, float] = {kind: 0.0 for kind in KINDS}

    def add(self, kind: str, op: str, payload: float, group: int, times: float = 1) -> None:
        self.sent[kind] += times * sent_bytes(op, payload, group)


def _replays(shape: Shape, layout: Layout, index: int, layer: int) -> Dict[str, int]:
    """How many times (0 or 1) each of a layer's sublayers runs forward again in backward."""
    again = layer_recompute(layout.recompute, shape.is_moe(layer), index)
    return dict(attention=int(again.whole), core_attention=int(again.whole or again.core_attention),
                mlp=int(again.whole or again.mlp), shared=int(again.whole or again.shared_expert))


def _tensor_parallel(traffic: Traffic, shape: Shape, layout: Layout, chunks: List[Chunk], tokens: Tokens,
                     activation_bytes: int, microbatches: int) -> None:
    t = layout.tp
    hidden = tokens.whole * shape.hidden * activation_bytes
    for chunk in chunks:
        for index, layer in enumerate(chunk.layers):
            moe = shape.is_moe(layer)
            replays = _replays(shape, layout, index, layer)
            sublayers = 1 if moe else 2  # an MoE layer's MLP is the experts' (EP), not TP
            again = replays["attention"] + (0 if moe else replays["mlp"])
            for op in ((ALL_GATHER, REDUCE_SCATTER) if layout.sp else (ALL_REDUCE,)):
                traffic.add("sp" if layout.sp else "tp", op, hidden, t,
                            microbatches * (SUBLAYER_COLLECTIVES[op] * sublayers + again))
            if moe and shape.shared_expert_ffn:  # a TP-split MLP beside the experts (MoE layers have SP)
                for op in (ALL_GATHER, REDUCE_SCATTER):
                    traffic.add("sp", op, hidden, t, microbatches * (SUBLAYER_COLLECTIVES[op] + replays["shared"]))
            if moe and layout.expert_tp > 1:
                # the routed tokens gathered over expert TP and scattered back, forward (and again when
                # the experts are recomputed), and their gradients the other way in backward
                routed = tokens.sharded * shape.topk * layout.expert_tp * shape.hidden * activation_bytes
                for op in (ALL_GATHER, REDUCE_SCATTER):
                    traffic.add("sp", op, routed, layout.expert_tp, microbatches * (2 + replays["mlp"]))
        if layout.sp:
            if chunk.first:  # the embedding reduce-scatters, or all-reduces to add learned positions and splits
                kind, op = ("tp", ALL_REDUCE) if shape.learned_positions else ("sp", REDUCE_SCATTER)
                traffic.add(kind, op, hidden, t, microbatches)
            # its gradient all-gathered; the output layer gathers its input, again in backward, and
            # reduce-scatters its input's gradient
            traffic.add("sp", ALL_GATHER, hidden, t, microbatches * (int(chunk.first) + 2 * int(chunk.last)))
            traffic.add("sp", REDUCE_SCATTER, hidden, t, microbatches * int(chunk.last))
        else:  # the embedding's all-reduce, the output layer's input gradient's
            traffic.add("tp", ALL_REDUCE, hidden, t, microbatches * (int(chunk.first) + int(chunk.last)))
        if chunk.last:  # the vocabulary-parallel cross entropy: max, target logit, sum of exponentials
            traffic.add("tp", ALL_REDUCE, tokens.whole * STAT, t, microbatches * 3)


def _summed_over_tp(params: List[Parameter], layout: Layout) -> int:
    """Elements of the gradients finalize_model_grads sums over TP."""
    return sum(p.local_numel(layout) for p in params
               if p.qk_norm or (layout.sp and p.tp_reduced and not p.expert))


def step_traffic(shape: Shape, layout: Layout, chunks: List[Chunk], params: List[List[Parameter]], variant: str,
                 tokens: Tokens, activation_bytes: int, microbatches: int, sharding: DataParallelSharding,
                 buffers: List[Dict[str, float]], gathered_kv: bool = False) -> Dict[str, float]:
    """The bytes this GPU sends in one step, by kind. ``params``, ``buffers``: each chunk's (``chunk_buffers``)."""
    traffic = Traffic()
    if layout.tp > 1:
        _tensor_parallel(traffic, shape, layout, chunks, tokens, activation_bytes, microbatches)
        reduced = sum(_summed_over_tp(chunk_params, layout) for chunk_params in params)
        traffic.add("tp", ALL_REDUCE, reduced * 4, layout.tp)
    width = shape.hidden * (1 if variant == STOCK else 2)
    streams = tokens.sharded * width * activation_bytes
    for chunk, chunk_params in zip(chunks, params):
        traffic.add("pp", SEND, streams, 2, microbatches * ((not chunk.last) + (not chunk.first)))
        if layout.pp > 1 and (chunk.first or chunk.last) and shape.tied:
            embedding = next(p for p in chunk_params if p.shared_embedding)
            traffic.add("pp", ALL_REDUCE, embedding.local_numel(layout) * 4, 2)
    for buffer in buffers:
        _data_parallel(traffic, buffer["grads"], buffer["weights"], dense_dp_size(layout), sharding, microbatches,
                       buffer.get("root_weights", 0.0))
        _data_parallel(traffic, buffer["expert_grads"], buffer["expert_weights"], expert_dp_size(layout), sharding,
                       microbatches)
    if layout.ep > 1:
        _expert_parallel(traffic, shape, layout, chunks, tokens, activation_bytes, microbatches)
    if layout.cp > 1 and gathered_kv:
        _context_parallel(traffic, shape, layout, chunks, tokens, activation_bytes, microbatches)
    return traffic.sent


def _context_parallel(traffic: Traffic, shape: Shape, layout: Layout, chunks: List[Chunk], tokens: Tokens,
                      activation_bytes: int, microbatches: int) -> None:
    cp = layout.cp
    keys = tokens.whole * cp * max(shape.groups // layout.tp, 1) * shape.head_dim * activation_bytes
    for chunk in chunks:
        for index, layer in enumerate(chunk.layers):
            forwards = microbatches * (1 + _replays(shape, layout, index, layer)["core_attention"])
            traffic.add("cp", ALL_GATHER, keys, cp, 2 * forwards)
            traffic.add("cp", REDUCE_SCATTER, keys, cp, 2 * microbatches)
        if chunk.last:
            traffic.add("cp", ALL_REDUCE, 2 * STAT, cp, microbatches)


def _data_parallel(traffic: Traffic, grads: float, weights: float, dp: int, sharding: DataParallelSharding,
                   microbatches: int, root_weights: float = 0.0) -> None:
    """``root_weights``: of ``weights``, the chunk's root's (not a decoder layer's)."""
    if dp == 1 or not grads:
        return
    if sharding.gathers_per_microbatch:  # sharded weights: for each forward and again for each backward
        once = root_weights if sharding.root_gathered_once else 0.0  # Megatron-FSDP's root: once a step
        traffic.add("dp", ALL_GATHER, weights - once, dp, sharding.gathers_per_microbatch * microbatches)
        traffic.add("dp", ALL_GATHER, once, dp)
    elif sharding.optimizer:  # the updated shards, once a step
        traffic.add("dp", ALL_GATHER, weights, dp)
    if sharding.reduce_every_microbatch:
        traffic.add("dp", REDUCE_SCATTER, grads, dp, microbatches)
    elif sharding.optimizer:
        traffic.add("dp", REDUCE_SCATTER, grads, dp)
    else:
        traffic.add("dp", ALL_REDUCE, grads, dp)


def _expert_parallel(traffic: Traffic, shape: Shape, layout: Layout, chunks: List[Chunk], tokens: Tokens,
                     activation_bytes: int, microbatches: int) -> None:
    ep = layout.ep
    routed = tokens.sharded * shape.topk
    for chunk in chunks:
        for index, layer in enumerate(chunk.layers):
            if not shape.is_moe(layer):
                continue
            forwards = microbatches * (1 + _replays(shape, layout, index, layer)["mlp"])
            # forward passes (again when recomputed), backward: the tokens there and back, their routing weights
            for times in (forwards, microbatches):
                traffic.add("ep", ALL_TO_ALL, routed * shape.hidden * activation_bytes, ep, 2 * times)
                traffic.add("ep", ALL_TO_ALL, routed * STAT, ep, times)
            traffic.add("ep", ALL_GATHER, ep * shape.experts * 8, ep, forwards)  # tokens per expert, int64
