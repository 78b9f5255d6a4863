"""Checkpoints for the tests of the commands that read one, without a training loop: a model of the
given settings, initialized from its seed, saved as the model-only checkpoint upcycle and import-hf
write (``training/checkpoint.save_model``), on the ranks of its layout. Both stacks can make them.
``load_full_model`` reads one back whole (TP = PP = 1, every weight unsharded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from megatron_siamese.inference.session import model_settings, open_session, read_checkpoint
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.settings import ModelSettings


def save_random(args, directory: str, step: int = 3) -> str:
    """On each rank of a joined job (``launch``): ``args``' model (a TrainArgs, its layout the
    job's) saved to ``directory/iter_<step>``; returns that path."""
    from megatron_siamese.training.checkpoint import save_model
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import MegatronGPT, initialize_model_parallel, transformer_config
    from megatron_siamese.training.args import padded_vocab_size

    initialize_model_parallel(args.layout, args.seed)
    chunks = build_model_chunks(transformer_config(args, args.layout), args, padded_vocab_size())
    path = save_model(chunks, args, directory, step=step)
    MegatronGPT.close()
    return path


@dataclass
class FullModel:
    """A checkpoint's whole model, unsharded (TP = PP = 1), on the CPU."""

    state_dict: Dict[str, torch.Tensor]  # the GPTModel's / HybridModel's own keys
    settings: ModelSettings
    tokenizer: Any  # data.corpus.ByteTokenizer
    vocab_size: int  # the padded vocabulary the embedding and output layer hold
    step: int
    checkpoint: str


def _full_model_rank(checkpoint: str, settings: Optional[ModelSettings], changes: dict) -> FullModel:
    session = open_session(checkpoint, Layout(), settings, **changes)
    try:
        state = {key: value.detach().to("cpu", copy=True) for key, value in session.chunks[0].state_dict().items()
                 if isinstance(value, torch.Tensor)}
        return FullModel(state, session.settings, session.tokenizer, session.vocab_size, session.step,
                         session.checkpoint)
    finally:
        session.close()


def load_full_model(checkpoint: str, settings: Optional[ModelSettings] = None, **changes) -> FullModel:
    """The whole model of ``checkpoint`` (saved at any layout) on one rank: spawned here, or this
    process as the one rank of a launched job. Bad input fails before any rank starts."""
    from megatron_siamese.runtime.launch import run_job

    model_settings(read_checkpoint(checkpoint), settings, **changes)  # refused here, not on a rank
    return run_job(_full_model_rank, 1, checkpoint, settings, changes, needs="loading the full model")
