"""Checkpoints for the tests of the commands that read one, without a training loop: a model of the
given settings, initialized from its seed, saved as the model-only checkpoint upcycle and import-hf
write (``training/checkpoint.save_model``), on the ranks of its layout. Both stacks can make them."""

from __future__ import annotations


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
