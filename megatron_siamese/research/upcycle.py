"""Pre-Norm upcycling: a stock Megatron Pre-Norm model becomes a SiameseNorm model.

Every weight the two share keeps its value (embeddings, attention, MLP, the sublayers'
InputNorms, the final norm). The X branch is switched off: every PostNorm and NormX gets
gamma = 0 and beta = 0, so u = PostNorm(x) = 0 never reaches a sublayer and the merge sees
only NormY(y). The Y branch's new norms (PreNorm, NormY) are plain (gamma = 1, beta = 0).
Each sublayer then computes InputNorm(Norm(y)) where Pre-Norm computed InputNorm(y): the
same function up to normalizing an already normalized vector, an O(eps / variance) change
(tests/test_research.py: fp32 precision with a small eps, ~1e-3 relative at eps = 1e-5 on a
trained model). Training continues from there and opens the X branch by itself.

Works on the model weights of any Megatron torch_dist checkpoint of the stock local or
Transformer Engine GPT layer (both store their InputNorms under TE's names); anything the
SiameseNorm GPT has no place for (MoE, QK-norm, MLA, biases it does not expect) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch

X_BRANCH = ("attn_x_norm.", "mlp_x_norm.", "merge.x_norm.", "output_merge.x_norm.")
Y_BRANCH = ("attn_y_norm.", "mlp_y_norm.", "merge.y_norm.", "output_merge.y_norm.")


def upcycled_state(pre_norm: Dict[str, torch.Tensor], siamese: Dict[str, torch.Tensor],
                   zero_centered_gamma: bool) -> Dict[str, torch.Tensor]:
    """The SiameseNorm state dict computing (up to eps) what the Pre-Norm state computes."""
    gamma_off, gamma_plain = (-1.0, 0.0) if zero_centered_gamma else (0.0, 1.0)
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
    from megatron_siamese.inference.session import open_session, save_model
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
    return run_job(_upcycle_rank, 1, pre_args, siamese_args, pre_checkpoint, needs="upcycle")
