"""Distributed checkpoints with megatron.core.dist_checkpointing (torch_dist format).

A checkpoint holds every model chunk's ``sharded_state_dict`` (global layer indices, TP shards
described by offsets), the optimizer's state sharded against it (for the distributed
optimizer in the format ``distributed_optimizer_format`` picks), the LR scheduler and the step. Loading builds the same sharded
description for the *current* layout and lets dist_checkpointing fetch the matching slices,
so a checkpoint saved at TP2 x PP2 loads at TP1 x PP1 and the reverse.

Layout and common state are Megatron-LM's (``checkpoint_files.py``: ``<dir>/iter_0000010/``,
``<dir>/latest_checkpointed_iteration.txt`` written atomically after every rank finished; the
common state's ``args``, ``iteration``, ``opt_param_scheduler``, ... as Megatron-LM's
``generate_state_dict`` writes them, and its sharded-state-dict content metadata), so
Megatron-LM's ``pretrain_gpt.py --load`` resumes a checkpoint of this trainer and the reverse
(docs/megatron-lm.md). Checkpoints of earlier releases (``step_<N>``, ``latest``) still load.

The run is deterministic without RNG state (no dropout; the data is a function of the step),
so no RNG state is stored (``args.no_save_rng``: Megatron-LM's loader then skips it).

On CPU the torch_dist writer hangs when psutil is missing (its worker calls a memory probe
outside its try block, dies, and the parent waits forever); psutil is a dependency, and
``require_psutil`` turns its absence into an error instead of a hang.
"""

from __future__ import annotations

import os
import shutil
from typing import List, Optional

import torch

from megatron_siamese.runtime import orphans
from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.training import async_save, checkpoint_strategy, megatron_lm_args, save_failures
from megatron_siamese.training.args import VOCAB_MULTIPLE
from megatron_siamese.training.checkpoint_files import (
    MODEL_CLASS,
    CheckpointError,
    brings_training_state,
    checked,
    common_state,
    damaged_shards,
    instead,
    iteration,
    iteration_dir,
    model_class,
    model_only,
    resolve,
    scheduler_state,
    write_latest,
)
from megatron_siamese.training.fsdp_checkpoint import describing_fsdp2_shards
from megatron_siamese.training.checkpoint_settings import (
    SETTINGS_KEY,
    model_problem,
    optimizer_split_problem,
    recorded,
)


def require_psutil() -> None:
    try:
        import psutil  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "megatron.core.dist_checkpointing's torch_dist writer hangs without psutil: "
            "pip install psutil"
        ) from error


def _metadata(trainer) -> dict:
    from megatron.core import parallel_state

    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if trainer.args.distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = distributed_optimizer_format()
    return metadata


def _content_metadata(metadata: dict) -> dict:
    """What Megatron-LM records of the sharded-state-dict metadata (``content_metadata``, read
    back by its loader to build the same description): the plain flags, not the process group."""
    return {key: value for key, value in metadata.items() if key != "dp_cp_group"}


def distributed_optimizer_format() -> str:
    """How the distributed optimizer's state is checkpointed.

    "fully_reshardable" reshards over TP, PP and DP, but megatron-core 0.16.1 cannot load it
    into torch.optim's Adam (its loader copies into every per-parameter state entry and torch
    keeps ``step`` there: KeyError 'step'), which is the Adam used without apex or Transformer
    Engine (CPU). There the format is "dp_reshardable" (Megatron-LM's default): it reshards
    over DP only, so a TP/PP change needs the non-distributed optimizer's checkpoint.

    Tried on CPU (torch's Adam) with "fully_reshardable" forced, on 0.16.1 and 0.19.2: a TP
    change fails in its loader (KeyError 'step') on both; its state does not load into the plain
    optimizer (0.16.1: KeyError 'pre_wd_mult', 0.19.2: its parameter groups do not match), nor
    does the plain optimizer's into it (no fp32 'param' entries). Such resumes are refused
    before any rank starts (``checkpoint_settings.optimizer_problem``), naming the layout to
    resume at or ``--no-load-optim``.
    """
    from megatron.core.optimizer import distrib_optimizer

    return "fully_reshardable" if distrib_optimizer.HAVE_APEX_OR_TE else "dp_reshardable"


def _models(trainer):
    """(key, module) per chunk, inside the DDP wrapper as Megatron-LM checkpoints them."""
    return [("model" if len(trainer.model) == 1 else f"model{i}", chunk.module)
            for i, chunk in enumerate(trainer.model)]


def sharded_state_dict(trainer, is_loading: bool, model_only: bool = False) -> dict:
    """The state Megatron-LM's ``generate_state_dict`` describes (its keys), plus the model class."""
    if trainer.args.use_torch_fsdp2:  # fsdp_checkpoint.py: two of Megatron's descriptions corrected
        with describing_fsdp2_shards(trainer.args.dp):
            return _sharded_state_dict(trainer, is_loading, model_only)
    return _sharded_state_dict(trainer, is_loading, model_only)


def _sharded_state_dict(trainer, is_loading: bool, model_only: bool) -> dict:
    metadata = _metadata(trainer)
    state = {key: module.sharded_state_dict(metadata=metadata) for key, module in _models(trainer)}
    state["args"] = megatron_lm_args.checkpoint_args(
        trainer.args, trainer.step, trainer.vocab_size, VOCAB_MULTIPLE, model_only=model_only
    )
    state["checkpoint_version"] = megatron_lm_args.CHECKPOINT_VERSION
    state["iteration"] = trainer.step
    state["num_floating_point_operations_so_far"] = 0  # not counted by this trainer
    state[MODEL_CLASS] = trainer.args.model
    if not is_loading:
        state[SETTINGS_KEY] = recorded(trainer.args)
    if not model_only:
        state["optimizer"] = trainer.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=metadata
        )
        state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    return state


def save(trainer, directory: str, model_only: bool = False) -> str:
    """Save the trainer's state under ``directory/iter_<N>`` and record it in the tracker file.

    ``model_only``: weights and step without optimizer or scheduler (a converted model, e.g. an
    upcycled one); loading it starts a fresh optimizer, like Megatron-LM's ``--no-load-optim``.
    With --overwrite, the run's first save first removes the old run's checkpoints. A leftover
    ``iter_<N>`` (a save that never finished) is replaced, never mixed with. A failed save
    (a full disk: ``save_failures``) leaves the tracker file on the last complete checkpoint.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    from megatron_siamese.training.preflight import clear_for_overwrite

    require_psutil()
    name = iteration_dir(trainer.step)
    path = os.path.join(directory, name)
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        if not trainer.saved_before:
            clear_for_overwrite(trainer.args)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
    trainer.saved_before = True
    orphans.checkpoint_writer_dies_with_its_rank()
    torch.distributed.barrier()
    in_background = getattr(trainer.args, "async_save", False) and not model_only
    try:
        request = dist_checkpointing.save(
            sharded_state_dict(trainer, is_loading=False, model_only=model_only), path,
            content_metadata=_content_metadata(_metadata(trainer)),
            **checkpoint_strategy.fully_parallel(trainer.args.ckpt_fully_parallel_save, "save"),
            **(async_save.save_keywords() if in_background else {}))
    except (Exception, CheckpointException) as error:
        failure = save_failures.failed(error, directory, name, rank0)
        if failure is error:
            raise
        raise failure from None
    step = trainer.step
    if in_background:  # complete once every rank's writer is done (complete_async_saves)
        async_save.schedule(request, lambda: _complete(directory, step), path)
    else:
        _complete(directory, step)
    return path


def _complete(directory: str, step: int) -> None:
    torch.distributed.barrier()  # every rank's shards are written: the checkpoint is complete
    if torch.distributed.get_rank() == 0:
        write_latest(directory, step)
    torch.distributed.barrier()


def complete_async_saves(blocking: bool) -> List[str]:
    """The --async-save checkpoints completed now (every rank calls it at the same points;
    ``blocking`` waits for all of them): their paths. A failed write raises as ``save`` does."""
    from torch.distributed.checkpoint import CheckpointException

    path = async_save.oldest_pending()
    try:
        return async_save.finish(blocking)
    except (Exception, CheckpointException) as error:
        failure = save_failures.failed(error, os.path.dirname(path), os.path.basename(path),
                                       torch.distributed.get_rank() == 0)
        if failure is error:
            raise
        raise failure from None


def _chained(optimizer) -> list:
    """The optimizers a Megatron ChainedOptimizer holds (dense and expert parameters), or the one."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before describing it for loading.

    torch.optim.Adam creates its state at the first step; without apex or Transformer
    Engine, megatron-core 0.16.1's DistributedOptimizer reads that state (its ``step``) while
    building the loading description and asserts when there is none. Megatron's own helper
    fills it with one zero-gradient step at the scheduler's initial learning rate; loading then
    overwrites the state and the parameters.
    """
    for inner in _chained(optimizer):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_step_count(optimizer, step: int, loaded_in_place: bool = False) -> None:
    """torch.optim.Adam's per-parameter ``step`` (its bias correction) after a load.

    Two megatron-core 0.16.1 problems meet here when torch's Adam is used (no apex, no
    Transformer Engine): the distributed optimizer's parameter-state load copies the loading
    template's placeholder ``step`` over the restored one, and the restored one is a single
    tensor shared by every parameter, which Adam then increments once per parameter per
    step. Each parameter gets its own tensor holding the training step (every step of this
    trainer updates: fp32/bf16 never skip one). State read in place (torch FSDP2) has none yet.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in _chained(optimizer):
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].new_tensor(float(step))
            elif loaded_in_place:
                state["step"] = torch.tensor(float(step))


def _load_gpt_into_hybrid(trainer, checkpoint: str) -> int:
    """A GPTModel checkpoint's weights into this HybridModel run, through Megatron's own
    load-time translation (``gpt_checkpoint_interop``: the i-th '*' takes GPT layer i's
    attention, the i-th '-' its MLP). The optimizer starts fresh: this trainer's checkpoints
    keep the distributed optimizer's state in a bucket-space format Megatron cannot translate."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )

    from megatron_siamese.hybrid_pattern import hybrid_pattern

    layer_maps = gpt_compatible_layer_maps(hybrid_pattern(trainer.args).text)
    state = {key: module.sharded_state_dict(metadata=_metadata(trainer)) for key, module in _models(trainer)}
    for sharded in state.values():
        retarget_sharded_state_dict_to_gpt_checkpoint(sharded, layer_maps)
    loaded = dist_checkpointing.load(state, checkpoint)
    for key, module in _models(trainer):
        module.load_state_dict(loaded[key])
    return _start_schedule_at(trainer, iteration(loaded))


def _start_schedule_at(trainer, step: int) -> int:
    """A fresh optimizer, the schedule continuing from ``step`` (counted in samples, as
    Megatron-LM's training loop steps it)."""
    trainer.step = step
    if step:
        trainer.scheduler.step(increment=step * trainer.args.global_batch_size)
    return step


def saved_optimizer_schedule(args) -> Optional[dict]:
    """The lr, min lr and weight decay to build the optimizer with when ``args.load`` brings its
    state back (None when it starts fresh). megatron-core 0.19 matches the saved parameter groups
    to the new optimizer's by their peak and final learning rates and weight decay, so they must
    be the checkpoint's; a run that overrides the checkpoint's schedule puts its own in place
    after loading (``load``), and one that differs without saying which wins is refused before
    any rank starts."""
    if not args.load:
        return None
    common = common_state(resolve(args.load))
    scheduler = scheduler_state(common, args.global_batch_size)
    if args.no_load_optim or not (brings_training_state(common, args.model) and scheduler):
        return None
    return dict(lr=scheduler["max_lr"], min_lr=scheduler["min_lr"], weight_decay=scheduler["start_wd"])


def _last_line(error: BaseException) -> str:
    """torch's CheckpointException prints every rank's traceback: its last line says what failed."""
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def load(trainer, path: str) -> int:
    """Load into the trainer's current layout; returns the checkpoint's step.

    A GPTModel checkpoint also loads into a HybridModel run (weights only, see
    ``_load_gpt_into_hybrid``); the reverse is refused."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    checkpoint = checked(path)
    common = common_state(checkpoint)
    saved_class, wanted_class = model_class(common), trainer.args.model
    if (saved_class, wanted_class) == ("gpt", "hybrid"):
        return _load_gpt_into_hybrid(trainer, checkpoint)
    if saved_class != wanted_class:
        raise ValueError(
            f"{checkpoint} holds a {saved_class} model and this run builds a {wanted_class} model; load it "
            f"with --model {saved_class} (a GPT checkpoint loads into --model hybrid, not the reverse)"
        )
    refused = model_problem(checkpoint, common, trainer.args)
    if refused:
        raise CheckpointError(refused)
    weights_only = model_only(common) or trainer.args.no_load_optim
    if not weights_only:
        # known only once Megatron built this run's optimizer: settings refused from the ranks (exit 2)
        split = optimizer_split_problem(checkpoint, common, len(_chained(trainer.optimizer)), trainer.args)
        if split:
            raise ConfigError([split])
        _materialize_optimizer_state(trainer.optimizer)
    try:
        loaded = dist_checkpointing.load(
            sharded_state_dict(trainer, is_loading=True, model_only=weights_only), checkpoint,
            **checkpoint_strategy.fully_parallel(trainer.args.ckpt_fully_parallel_load, "load", checkpoint)
        )
    except (Exception, CheckpointException) as error:
        damaged = damaged_shards(checkpoint)  # the files looked sound before: read every item now
        if damaged:
            raise CheckpointError(f"cannot load {checkpoint}: {damaged[0]} is corrupt (an item in it does not read "
                                  f"back); {instead(checkpoint)}") from None
        raise CheckpointError(  # the model or optimizer does not match the files
            f"cannot load {checkpoint} into this run ({type(error).__name__}: {_last_line(error)[:300]}); check that "
            "the model flags (layers, hidden size, heads, normalization, scheme) are the ones it was saved with, or "
            "pass --no-load-optim to load the weights alone"
        ) from None
    in_place = trainer.args.use_torch_fsdp2  # read into the FSDP2 shards themselves (fsdp_checkpoint.py)
    if not in_place:
        for key, module in _models(trainer):
            module.load_state_dict(loaded[key])
    if weights_only:  # a fresh optimizer; the schedule continues from the checkpoint's step
        return _start_schedule_at(trainer, iteration(loaded))
    if in_place:  # the Adam moments are in place; the step count where the optimizer keeps it
        for group, saved in zip(trainer.optimizer.param_groups, loaded["optimizer"]["param_groups"]):
            if "step" in saved:
                group["step"] = saved["step"]
    else:
        with torch.no_grad():  # fp32 distributed-optimizer state is copied into parameter views
            trainer.optimizer.load_state_dict(loaded["optimizer"])
    trainer.step = iteration(loaded)
    if trainer.step < trainer.args.steps:  # evaluating the checkpoint as saved needs no schedule
        if trainer.args.override_opt_param_scheduler:
            # the parameter groups hold the checkpoint's peak and final learning rates (and weight
            # decay), which Megatron's scheduler reads before its own: the run's win
            for group in trainer.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = trainer.args.lr, trainer.args.min_lr
                for key in ("start_wd", "end_wd"):
                    if key in group:
                        group[key] = trainer.args.weight_decay
        trainer.scheduler.load_state_dict(scheduler_state(loaded, trainer.args.global_batch_size))
    _restore_adam_step_count(trainer.optimizer, trainer.step, loaded_in_place=in_place)
    return trainer.step
