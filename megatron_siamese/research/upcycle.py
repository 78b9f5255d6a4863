"""Pre-Norm upcycling: a stock Megatron Pre-Norm model becomes a SiameseNorm model.

Shared weights keep their values; every PostNorm and NormX gets gamma = beta = 0, so the X branch is off, and
the new PreNorms and NormY are plain. Each sublayer then computes InputNorm(Norm(y)) for InputNorm(y): the same
function up to normalizing twice, an O(eps / variance) change. Stock MTP layers carry over (the same eps effect);
the flags must give the checkpoint's number of them, or a checkpoint without settings would silently lose them.
docs/research.md, "Upcycling a Pre-Norm model".
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterable

import torch

X_BRANCH = ("attn_x_norm.", "mlp_x_norm.", "merge.x_norm.", "output_merge.x_norm.")
Y_BRANCH = ("attn_y_norm.", "mlp_y_norm.", "merge.y_norm.", "output_merge.y_norm.")
MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")  # a multi-token prediction layer's weight, as GPTModel names it


def mtp_layers(names: Iterable[str]) -> int:
    """How many multi-token prediction layers the model weights ``names`` hold."""
    return len({match.group(1) for match in map(MTP_LAYER.match, names) if match})


def mtp_mismatch(held: int, asked: int) -> str:
    """What to change when a Pre-Norm model holding ``held`` MTP layers is upcycled into ``asked``."""
    change = f"give --mtp-num-layers {held}" if held else "drop --mtp-num-layers"
    return (f"it holds {held} multi-token prediction layer{'s' if held != 1 else ''}, the flags describe {asked}: "
            f"{change} (upcycle carries the MTP layers over as they are)")


def upcycled_state(pre_norm: Dict[str, torch.Tensor], siamese: Dict[str, torch.Tensor],
                   zero_centered_gamma: bool) -> Dict[str, torch.Tensor]:
    """The SiameseNorm state dict computing (up to eps) what the Pre-Norm state computes."""
    gamma_off, gamma_plain = (-1.0, 0.0) if zero_centered_gamma else (0.0, 1.0)
    held, asked = mtp_layers(pre_norm), mtp_layers(siamese)
    if held != asked:
        raise ValueError(f"cannot upcycle the Pre-Norm model: {mtp_mismatch(held, asked)}")
    unexpected = sorted(k for k in pre_norm if k not in siamese and not k.endswith("_extra_state"))
    if unexpected:
        raise ValueError(
            f"cannot upcycle: the Pre-Norm checkpoint has weights with no SiameseNorm place: {unexpected[:5]} "
            "(MoE, QK-norm, MLA and other layer types are not supported; match the model flags)"
        )
    state = {}
    for name, tensor in siamese.items():
        if name.endswith("_extra_state"):
            state[name] = tensor
        elif name in pre_norm:
            if pre_norm[name].shape != tensor.shape:
                raise ValueError(f"cannot upcycle {name}: shape {tuple(pre_norm[name].shape)} in the "
                                 f"checkpoint, {tuple(tensor.shape)} in the SiameseNorm model")
            state[name] = pre_norm[name].clone()
        elif any(part in name for part in X_BRANCH):
            state[name] = torch.full_like(tensor, gamma_off if name.endswith("weight") else 0.0)
        elif any(part in name for part in Y_BRANCH):
            state[name] = torch.full_like(tensor, gamma_plain if name.endswith("weight") else 0.0)
        else:
            raise ValueError(f"cannot upcycle: the checkpoint has no weight for {name}")
    return state


def _upcycle_rank(pre_args, siamese_args, pre_checkpoint: str) -> str:
    from megatron_siamese import device
    from megatron_siamese.inference.session import open_session
    from megatron_siamese.training.checkpoint import save_model
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import MegatronGPT, initialize_model_parallel, transformer_config

    # model weights only (the flags must describe the Pre-Norm model): ours and Megatron-LM's alike
    pre = open_session(pre_checkpoint, settings=pre_args, seed=pre_args.seed)
    pre_model = pre.chunks[0]
    pre_state = pre_model.state_dict()
    zero_centered = pre_model.config.layernorm_zero_centered_gamma
    pre.close()
    initialize_model_parallel(siamese_args.layout, siamese_args.seed)
    try:
        config = transformer_config(siamese_args, siamese_args.layout)
        (model,) = build_model_chunks(config, siamese_args, pre.vocab_size)
        model.to(device.current())
        model.load_state_dict(upcycled_state(pre_state, model.state_dict(), zero_centered))
        return save_model([model], siamese_args, siamese_args.output_dir + "/checkpoints")
    finally:
        MegatronGPT.close()


def upcycle(args, pre_checkpoint: str) -> str:
    """Write a step-0 SiameseNorm checkpoint (fresh optimizer) to ``args.output_dir/checkpoints``
    from the Pre-Norm checkpoint; ``args`` describes the model (TP=PP=1)."""
    from megatron_siamese.runtime.launch import run_job

    if (args.tp, args.pp) != (1, 1):
        raise ValueError("upcycle at tp=1, pp=1; the checkpoint reshards afterwards")
    from megatron_siamese.inference.session import model_settings, read_checkpoint
    from megatron_siamese.training.checkpoint_files import CheckpointError

    pre_args = dataclasses.replace(args, norm="pre", load=None)
    siamese_args = dataclasses.replace(args, norm="siamese", load=None)
    # another model refused here, not on a rank
    saved = read_checkpoint(pre_checkpoint)
    if saved.settings is not None and saved.settings.norm != "pre":
        raise CheckpointError(f"--load {saved.path} holds a {saved.settings.norm} model: upcycle converts a stock "
                              "Pre-Norm checkpoint (--norm pre, or Megatron-LM's)")
    model_settings(saved, pre_args)
    held, asked = checkpoint_mtp_layers(saved.path), args.mtp_num_layers or 0
    if held != asked:  # a checkpoint recording its settings was refused above, listing every difference
        raise CheckpointError(f"--load {saved.path}: {mtp_mismatch(held, asked)}")
    return run_job(_upcycle_rank, 1, pre_args, siamese_args, pre_checkpoint, needs="upcycle")


def checkpoint_mtp_layers(checkpoint: str) -> int:
    """How many MTP layers a torch_dist checkpoint's model holds, from its tensors' names (the flags cannot tell)."""
    from torch.distributed.checkpoint import FileSystemReader

    return mtp_layers(FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
