"""Planted bugs, for proving that the correctness check can fail (``check --plant-fault``).

Each is a realistic mistake a SiameseNorm integration (or a baseline's) could make, patched into this
process's classes before the model is built and undone after the layout. The layer never imports this.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

_UNDO: List[Tuple[object, str, object]] = []  # (owner, attribute, its own value before) of what is planted
_INHERITED = object()  # the owner had no value of its own (a class inheriting it)


def _patch(owner, name: str, value) -> None:
    """``owner.name = value``, undone by ``planted``'s exit."""
    _UNDO.append((owner, name, vars(owner).get(name, _INHERITED)))
    setattr(owner, name, value)


def _local_depth_scale() -> None:
    """c = sqrt(2 * local layer index): wrong on every pipeline stage but the first."""
    from megatron_siamese import layer as layer_module
    from megatron_siamese.reference.functional import depth_scale

    original_init = layer_module.SiameseTransformerLayer.__init__

    def init(self, config, submodules, layer_number=1, **kwargs):
        original_init(self, config, submodules, layer_number=layer_number, **kwargs)
        self.depth_scale = depth_scale(layer_number)  # the local number, before the offset

    _patch(layer_module.SiameseTransformerLayer, "__init__", init)


def _norms_without_sequence_parallel_flag() -> None:
    """Norm parameters not tagged ``sequence_parallel``: their SP gradients stay partial."""
    from megatron_siamese import norms

    original_init = norms.TorchNorm.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        for param in self.parameters():
            param.sequence_parallel = False

    _patch(norms.TorchNorm, "__init__", init)


def _experts_reduced_over_data_parallel() -> None:
    """Expert parameters not tagged ``allreduce=False``: DDP reduces their gradients over the whole DP
    group instead of the expert-data-parallel one, summing different experts' gradients under EP."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original_init = MoELayer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        for param in self.experts.parameters():
            param.allreduce = True

    _patch(MoELayer, "__init__", init)


def _aux_loss_averaged_over_data_parallel_twice() -> None:
    """The aux loss's gradient scale divided by the DP size as well (as if DDP summed gradients
    rather than averaging them): the router's gradients shrink on every DP > 1 layout."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.set_loss_scale

    def set_loss_scale(scale):
        original(scale / parallel_state.get_data_parallel_world_size())

    _patch(MoEAuxLossAutoScaler, "set_loss_scale", staticmethod(set_loss_scale))


def _qk_norm_without_config_flag() -> None:
    """QK-norm in the layers but not in the config's ``qk_layernorm``, which gradient finalization
    reads: each TP rank's QK-norm gradient covers only its own heads, never summed over TP."""
    import copy
    import importlib

    # the module (megatron.core.distributed re-exports its function under the same name)
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    original = finalize._allreduce_non_tensor_model_parallel_grads

    def allreduce(model, config, *args, **kwargs):
        config = copy.copy(config)
        config.qk_layernorm = False
        return original(model, config, *args, **kwargs)

    _patch(finalize, "_allreduce_non_tensor_model_parallel_grads", allreduce)


def _value_norm_unreduced() -> None:
    """HybridNorm's value norm without its sum over TP: each rank's gradient covers only its own
    heads (a per-head norm Megatron's finalize_model_grads does not know by name)."""
    from megatron_siamese import qkv_norm

    _patch(qkv_norm.ValueNorm, "forward", lambda self, x: self.normalized(x, self.weight, self.bias))


def _baseline_placement_by_local_layer_number() -> None:
    """A single-stream baseline placing its norms by the layer's number on its own stage: Mix-LN
    then starts Post-Norm layers again on every pipeline stage (and virtual stage)."""
    from megatron_siamese import single_stream

    layer = single_stream.SingleStreamTransformerLayer
    original_init, original_placement = layer.__init__, layer._placement
    local = {}

    def init(self, config, submodules, layer_number=1, **kwargs):
        local["number"] = layer_number  # before Megatron adds the stage's offset
        original_init(self, config, submodules, layer_number=layer_number, **kwargs)

    def placement(self):
        number, self.layer_number = self.layer_number, local["number"]
        try:
            return original_placement(self)
        finally:
            self.layer_number = number

    _patch(layer, "__init__", init)
    _patch(layer, "_placement", placement)


def _stream_norms_left_out_of_torch_fsdp() -> None:
    """The X/Y stream norms left out of FSDP2's units (``ignored_params``): FSDP2 neither shards nor
    reduces them, and each DP rank steps them with its own gradient."""
    import importlib

    from megatron_siamese.layer import SiameseTransformerLayer

    wrapper = importlib.import_module("megatron.core.distributed.torch_fully_sharded_data_parallel")
    original = wrapper.fully_shard

    def fully_shard(module, **kwargs):
        norms = [norm for layer in module.modules() if isinstance(layer, SiameseTransformerLayer)
                 for norm in (layer.attn_x_norm, layer.attn_y_norm, layer.mlp_x_norm, layer.mlp_y_norm)]
        kwargs["ignored_params"] = {param for norm in norms for param in norm.parameters()}
        return original(module, **kwargs)

    _patch(wrapper, "fully_shard", fully_shard)


def _mla_column_parallel_down_projections() -> None:
    """MLA's down projections split over TP (ColumnParallelLinear, as Megatron's local spec), not
    duplicated (mla.py): the decoupled RoPE key's gradient is never summed over TP."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_siamese import specs

    _patch(specs, "DuplicatedLinear", ColumnParallelLinear)


def _mtp_embedding_unsynced() -> None:
    """With multi-token prediction, the last stage's copy of the word embedding (the MTP layers'
    and, tied, the output layer's) not summed with the first stage's: each stage steps its own."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    original = finalize._allreduce_word_embedding_grads

    def allreduce(model, config, *args, **kwargs):
        if not getattr(config, "mtp_num_layers", None):
            original(model, config, *args, **kwargs)

    _patch(finalize, "_allreduce_word_embedding_grads", allreduce)


def _stream_norms_reduced_over_data_parallel_only() -> None:
    """The stream norms' gradients averaged over ``get_data_parallel_group()``, which leaves CP out:
    each CP rank keeps its own chunks' gradient (Megatron-LM#1528's kind)."""
    import torch

    import megatron.core.distributed as distributed
    from megatron.core import parallel_state

    from megatron_siamese.layer import SiameseTransformerLayer

    original = distributed.finalize_model_grads

    def finalize(model, *args, **kwargs):
        norms = [norm for chunk in model for layer in chunk.modules() if isinstance(layer, SiameseTransformerLayer)
                 for norm in (layer.attn_x_norm, layer.attn_y_norm, layer.mlp_x_norm, layer.mlp_y_norm)]
        local = [(param, param.main_grad.clone()) for norm in norms for param in norm.parameters()]
        result = original(model, *args, **kwargs)
        group = parallel_state.get_data_parallel_group()
        for param, grad in local:
            torch.distributed.all_reduce(grad, group=group)
            param.main_grad.copy_(grad / group.size())
        return result

    _patch(distributed, "finalize_model_grads", finalize)


def _cp_contiguous_chunks() -> None:
    """Each CP rank given a contiguous piece of the sequence, while Megatron's RoPE and CP attention
    expect chunks r and 2 cp - 1 - r."""
    from megatron_siamese import context_parallel

    def batch_on_rank(batch, cp, rank):
        pieces = {}
        for name, tensor in batch.items():
            if tensor is None or name == "cu_seqlens":  # a packed batch's bounds stay whole
                pieces[name] = tensor
                continue
            dim = 2 if name == "attention_mask" else 1
            size = tensor.size(dim) // cp
            pieces[name] = tensor.narrow(dim, rank * size, size)
        return pieces if cp > 1 else batch

    _patch(context_parallel, "batch_on_rank", batch_on_rank)


def _cp_keys_in_sequence_order() -> None:
    """The context-parallel attention masking the all-gathered keys as if they were in sequence
    order, not in the ranks' order of their chunks (r, 2 cp - 1 - r; of each document, packed)."""
    import torch

    from megatron_siamese import core_attention

    _patch(core_attention, "gathered_positions", lambda seq_length, cp: torch.arange(seq_length))
    _patch(core_attention, "gathered_document_positions", lambda cu_seqlens, cp: torch.arange(int(cu_seqlens[-1])))


FAULTS: Dict[str, Callable[[], None]] = {
    "local-depth-scale": _local_depth_scale,
    "no-sp-flag": _norms_without_sequence_parallel_flag,
    "experts-reduced-over-dp": _experts_reduced_over_data_parallel,
    "aux-loss-over-dp": _aux_loss_averaged_over_data_parallel_twice,
    "qk-norm-unreduced": _qk_norm_without_config_flag,
    "stream-norms-outside-fsdp": _stream_norms_left_out_of_torch_fsdp,
    "value-norm-unreduced": _value_norm_unreduced,
    "baseline-local-layer-number": _baseline_placement_by_local_layer_number,
    "mla-column-parallel-down-projections": _mla_column_parallel_down_projections,
    "mtp-embedding-unsynced": _mtp_embedding_unsynced,
    "stream-norms-reduced-over-dp-only": _stream_norms_reduced_over_data_parallel_only,
    "cp-contiguous-chunks": _cp_contiguous_chunks,
    "cp-keys-in-sequence-order": _cp_keys_in_sequence_order,
}


def acted_nowhere(name: Optional[str], statuses: Sequence[str]) -> Optional[str]:
    """What to tell a user whose planted fault failed no layout (else None): where it acts, or the pass reads
    as the check being blind to it."""
    if name is None or any(status in ("FAIL", "ERROR") for status in statuses):
        return None
    where = " ".join(inspect.getdoc(FAULTS[name]).split())
    return f"--plant-fault {name} failed no layout: it acts on none of these. {where}"


@contextlib.contextmanager
def planted(name: Optional[str]) -> Iterator[None]:
    """Fault ``name`` (None: none) planted in this process for the duration."""
    if name is not None and name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose one of {sorted(FAULTS)}")
    depth = len(_UNDO)
    try:
        if name is not None:
            FAULTS[name]()
        yield
    finally:
        while len(_UNDO) > depth:
            owner, attribute, value = _UNDO.pop()
            if value is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, value)
