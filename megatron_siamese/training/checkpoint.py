"""Model-only checkpoints in Megatron-LM's layout (torch_dist, through dist_checkpointing): what
``upcycle`` and ``import-hf`` write, and the sharded description every reader of a checkpoint loads with.
Megatron-LM's keys and common state with ``no_save_optim``, so its loop starts them with a fresh optimizer.

On CPU the torch_dist writer hangs without psutil (its worker calls a memory probe outside its try
block, dies, and the parent waits forever): ``require_psutil`` makes that an error instead.
"""

from __future__ import annotations

import os
import shutil
from typing import List, Optional

import torch

from megatron_siamese.runtime import orphans
from megatron_siamese.training import megatron_lm_args
from megatron_siamese.training.args import VOCAB_MULTIPLE, padded_vocab_size
from megatron_siamese.training.checkpoint_files import MODEL_CLASS, iteration_dir, write_latest
from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, recorded

# what Megatron-LM records of the sharded-state-dict metadata (read back by its loader)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def require_psutil() -> None:
    try:
        import psutil  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "megatron.core.dist_checkpointing's torch_dist writer hangs without psutil: "
            "pip install psutil"
        ) from error


def sharded_model_state(chunks: List[torch.nn.Module]) -> dict:
    """This rank's model chunks as dist_checkpointing describes them, under Megatron-LM's keys."""
    from megatron.core import parallel_state

    metadata = {**CONTENT_METADATA,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    return {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in zip(keys, chunks)}


def save_model(chunks: List[torch.nn.Module], args, directory: str, step: int = 0,
               vocab_size: Optional[int] = None) -> str:
    """This rank's ``chunks`` of the model ``args`` describes, saved model-only at ``directory/iter_<step>``
    (a leftover one replaced, never mixed with); returns that path."""
    from megatron.core import dist_checkpointing

    require_psutil()
    path = os.path.join(directory, iteration_dir(step))
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
    orphans.checkpoint_writer_dies_with_its_rank()
    torch.distributed.barrier()
    state = sharded_model_state(chunks)
    vocab_size = vocab_size or getattr(chunks[0], "vocab_size", None) or padded_vocab_size()  # the model's own
    state["args"] = megatron_lm_args.checkpoint_args(args, step, vocab_size, VOCAB_MULTIPLE)
    state["checkpoint_version"] = megatron_lm_args.CHECKPOINT_VERSION
    state["iteration"] = step
    state["num_floating_point_operations_so_far"] = 0
    state[MODEL_CLASS] = args.model
    state[SETTINGS_KEY] = recorded(args)
    dist_checkpointing.save(state, path, content_metadata=dict(CONTENT_METADATA))
    torch.distributed.barrier()  # every rank's shards are written: the checkpoint is complete
    if rank0:
        write_latest(directory, step)
    torch.distributed.barrier()
    return path


def last_line(error: BaseException) -> str:
    """torch's CheckpointException prints every rank's traceback: its last line says what failed."""
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
