"""torch FSDP2's DTensor parameters in Megatron's torch_dist checkpoints.

Megatron describes a fully sharded parameter as a ShardedTensor of its local shard: FSDP2 cuts
the (TP-local) parameter into ``dp`` equal row blocks, and ``make_tp_sharded_tensor_for_checkpoint``
places DP rank d of TP rank r at row block ``r * dp + d`` of the global tensor, the same global
tensor a DDP or TP run saves, so a checkpoint reshards between FSDP2 and the other layouts.
``describing_fsdp2_shards`` corrects two descriptions while a checkpoint is described:

* A gated MLP's ``linear_fc1`` (SwiGLU: the TP-local rows are ``[gate_r; up_r]``), before
  megatron-core 0.19: ``apply_swiglu_sharded_factory`` (transformer/mlp.py) splits each local
  shard in two halves as if it held a TP rank's gate and up rows, but under FSDP2 DP rank d
  holds row block d of ``[gate_r; up_r]`` (for dp 2: the gate rows on rank 0, the up rows on
  rank 1). Saved so, a checkpoint loads back into the same FSDP2 layout and nowhere else
  (measured: the losses off after loading it at TP2). Here the shard is one ShardedTensor at
  the row block it is: every TP rank's gate blocks first, then the up blocks
  (``_gated_rows_block``), which needs each DP rank's rows whole and inside one half: an even dp
  dividing the TP rank's ``2 ffn / tp`` rows (``gated_mlp_problem`` refuses the rest before any
  rank starts).
  megatron-core 0.19's factory takes the DP group and places the shard the same way (its
  ``dp_sh_ten_build_fn``, asserting the same rule); there it is left alone.
* The optimizer's state (0.16.1 and 0.19.2, torch 2.13 and later): it is mapped to those
  descriptions by the identity of the local shard, ``get_optim_param_to_id_map`` keying each
  parameter by ``id(to_local_if_dtensor(param))`` and the model's description holding
  ``param._local_tensor``. torch 2.13 made ``to_local()`` of a Parameter(DTensor) return a
  fresh view on every call (pytorch gh-166156, so that the result stays a Parameter), so no
  optimizer parameter matches ("Param id 0 does not match any model sharded param"). Here that
  lookup sees the shard itself.

Loading follows Megatron-LM's FSDP2 path: dist_checkpointing reads every shard in place into
the tensors the description holds (the parameters' and the optimizer state's local shards),
so neither the model's nor the optimizer's ``load_state_dict`` runs afterwards (Megatron's
TorchFullyShardedDataParallel.load_state_dict is a no-op for the same reason).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect


def _gated_rows_block(index: int, blocks: int, dp: int) -> int:
    """The row block of ``[gate; up]`` (``blocks = tp x dp`` of them) that FSDP2's DP rank holds,
    given Megatron's TP-order index ``tp_rank x dp + dp_rank`` for it: the first half of a TP
    rank's DP ranks hold its gate rows, the second half its up rows."""
    tp_rank, dp_rank = divmod(index, dp)
    half = dp // 2
    if dp_rank < half:
        return tp_rank * half + dp_rank
    return blocks // 2 + tp_rank * half + dp_rank - half


@contextlib.contextmanager
def describing_fsdp2_shards(dp: int):
    """While a torch-FSDP2 model and its optimizer describe their checkpoint: the two
    corrections of the module docstring (``dp``: the data-parallel size the shards are cut by)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.tensor import DTensor

    mlp = importlib.import_module("megatron.core.transformer.mlp")
    optimizer = importlib.import_module("megatron.core.dist_checkpointing.optimizer")
    originals = mlp.apply_swiglu_sharded_factory, optimizer.to_local_if_dtensor

    def gated_rows(original, sharded_offsets, singleton_local_shards: bool = False):
        axis = len(sharded_offsets)  # the rows, after the layer-stacking axes
        blocks = original.axis_fragmentations[axis]
        index = original.global_offset[axis] // original.local_shape[0]
        return ShardedTensor.from_rank_offsets(
            original.key, original.data, *sharded_offsets, (axis, _gated_rows_block(index, blocks, dp), blocks),
            replica_id=original.replica_id, prepend_axis_num=axis)

    def local_shard(tensor):
        return tensor._local_tensor if isinstance(tensor, DTensor) else originals[1](tensor)

    # megatron-core 0.19 describes FSDP2's gated rows itself (the factory takes the DP group): keep its own
    fixed = "dp_group" in inspect.signature(originals[0]).parameters
    mlp.apply_swiglu_sharded_factory = originals[0] if fixed else gated_rows
    optimizer.to_local_if_dtensor = local_shard
    try:
        yield
    finally:
        mlp.apply_swiglu_sharded_factory, optimizer.to_local_if_dtensor = originals


def gated_mlp_problem(use_torch_fsdp2: bool, gated: bool, dp: int, ffn: int, tp: int):
    """An FSDP2 split the gated-MLP description cannot express, or None: FSDP2 cuts a TP rank's
    ``[gate; up]`` rows (``2 ffn / tp``) into ``dp`` blocks of ``ceil(2 ffn / tp / dp)`` rows, and
    each block must be whole and lie in one half (``_gated_rows_block``, and megatron-core 0.19's
    own ``dp_sh_ten_build_fn``, which asserts the same): an even ``dp`` dividing ``2 ffn / tp``."""
    if not (use_torch_fsdp2 and gated) or dp <= 1 or tp < 1 or ffn % tp:
        return None
    half = ffn // tp  # gate (or up) rows of one TP rank
    if dp % 2 == 0 and half % (dp // 2) == 0:
        return None
    good = [d for d in range(2, 2 * half + 1, 2) if half % (d // 2) == 0]
    return (f"--use-torch-fsdp2 with a gated MLP (--swiglu) cannot checkpoint --dp {dp} with an MLP width of {ffn} "
            f"over --tp {tp}: FSDP2 cuts each TP rank's {2 * half} linear_fc1 rows ({half} gate, {half} up) into "
            f"--dp row blocks, and each must be whole and lie in one half; use an even --dp dividing {2 * half} "
            f"({', '.join(map(str, good))}), or an --ffn-hidden-size that splits so")
