"""A checkpoint's model on this rank, for reading and running its weights: no optimizer, no data,
no schedule (training is Megatron-LM's loop). ``open_session`` builds this rank's chunks from the settings the
checkpoint records and loads the weights, resharded from whatever layout saved them; ``read_checkpoint`` reads
what a checkpoint holds without starting any rank. docs/inference.md, "The model session".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.settings import ModelSettings
from megatron_siamese.training.checkpoint_files import CheckpointError


@dataclass(frozen=True)
class SavedCheckpoint:
    """What one checkpoint holds, read without building a model."""

    path: str  # the complete iter_<N> directory a checkpoints directory's tracker names
    step: int
    model_class: str  # "gpt" or "hybrid"
    settings: Optional[ModelSettings]  # None: the checkpoint records none (Megatron-LM's, older releases)
    vocab_size: Optional[int] = None  # the padded vocabulary it was trained with (Megatron-LM pads per TP)


def recorded_settings(common: Dict[str, Any]) -> Optional[ModelSettings]:
    """The ModelSettings a checkpoint's common state records (ours, else read from Megatron-LM's args), or None."""
    from megatron_siamese.inference.saved_args import settings_from_args
    from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY

    saved = common.get(SETTINGS_KEY)
    if not isinstance(saved, dict):
        return settings_from_args(common["args"]) if "args" in common else None
    fields = {f.name for f in dataclasses.fields(ModelSettings)}
    return ModelSettings(**{key: value for key, value in saved.items() if key in fields})


def read_checkpoint(path: str) -> SavedCheckpoint:
    """The checkpoint ``path`` names (a checkpoints directory or one iter_<N>), verified;
    CheckpointError (one line) for a missing or broken one."""
    from megatron_siamese.training import checkpoint_files

    checkpoint = checkpoint_files.checked(path)
    try:
        common = checkpoint_files.common_state(checkpoint)
    except Exception as error:  # noqa: BLE001  (whatever Megatron's reader raises: one line)
        raise CheckpointError(f"cannot read the common state of {checkpoint}: {type(error).__name__}: "
                              f"{str(error).strip().splitlines()[-1][:200] if str(error).strip() else ''}") from None
    return SavedCheckpoint(checkpoint, checkpoint_files.iteration(common), checkpoint_files.model_class(common),
                           recorded_settings(common), getattr(common.get("args"), "padded_vocab_size", None))


def model_settings(saved: SavedCheckpoint, settings: Optional[ModelSettings] = None, **changes) -> ModelSettings:
    """The settings to build ``saved``'s model with: the recorded ones, else ``settings`` (which must then
    describe the same model); ``changes`` only settings the weights do not depend on."""
    from megatron_siamese.training.checkpoint_settings import SETTINGS_KEY, model_fields, model_problem

    fixed = sorted(set(changes) & set(model_fields()))
    if fixed:
        raise ValueError(f"cannot change {', '.join(fixed)} of a trained model (the weights depend on them)")
    if settings is not None:
        if saved.model_class != settings.model:
            raise CheckpointError(f"{saved.path} holds a {saved.model_class} model, not a {settings.model} model: "
                                  f"use --model {saved.model_class}")
        if saved.settings is not None:
            refused = model_problem(saved.path, {SETTINGS_KEY: dataclasses.asdict(saved.settings)}, settings,
                                    flags_describe=True)
            if refused:
                raise CheckpointError(refused)
        chosen = settings
    elif saved.settings is not None:
        chosen = saved.settings
    else:
        raise CheckpointError(f"{saved.path} records no model settings (Megatron-LM's or an earlier release's "
                              "checkpoint): give its model flags (layers, hidden size, heads, ...)")
    return dataclasses.replace(chosen, **changes)


def layout_problems(settings: ModelSettings, layout: Layout, world_size: Optional[int] = None,
                    vocab_size: Optional[int] = None) -> List[str]:
    """What of ``settings``' model does not split over ``layout`` (or ``world_size``), one line each; ``vocab_size``:
    the checkpoint's padded vocabulary, where it records one. Rules about gradients do not apply (MLA runs under
    TP without SP here)."""
    from megatron_siamese.runtime.divisibility import split_problems
    from megatron_siamese.training.args import padded_vocab_size

    found = split_problems(settings, layout, vocab_size=vocab_size or padded_vocab_size(), micro_batch_size=1,
                           global_batch_size=layout.dp, training=False)
    if world_size is not None and world_size != layout.world_size:
        found.append(f"the layout {layout.name} uses {layout.world_size} ranks, the job has {world_size}")
    return found


class ModelSession:
    """This rank's chunks of a checkpoint's model under a layout, in eval mode, process groups up until
    ``close``. ``with_mtp=False``: without the multi-token prediction layers, as inference runs it."""

    def __init__(self, saved: SavedCheckpoint, settings: ModelSettings, layout: Layout, seed: int = 1234,
                 with_mtp: bool = True):
        from megatron_siamese import device
        from megatron_siamese.models import build_model_chunks
        from megatron_siamese.runtime.gpt import initialize_model_parallel, transformer_config
        from megatron_siamese.training.args import padded_vocab_size
        from megatron_siamese.data.corpus import ByteTokenizer

        self.checkpoint, self.step, self.settings, self.layout = saved.path, saved.step, settings, layout
        self.tokenizer = ByteTokenizer()
        self.vocab_size = saved.vocab_size or padded_vocab_size(self.tokenizer.vocab_size)
        # process groups someone else set up for this layout (a test's single rank) are used as
        # they are and left up; else the session's own, torn down by close()
        self._owns_groups = not _groups_for(layout)
        if self._owns_groups:
            initialize_model_parallel(layout, seed)
        try:
            # without mtp_num_layers in the config GPTModel builds no MTP block and its output
            # wants no labels; dist_checkpointing then leaves the checkpoint's MTP keys unread
            self.config = transformer_config(settings, layout, **({} if with_mtp else {"mtp_num_layers": None}))
            chunks = build_model_chunks(self.config, settings, self.vocab_size)
            if device.uses_cuda():
                chunks = [chunk.to(device.current()) for chunk in chunks]
            self.chunks: List[torch.nn.Module] = chunks  # GPTModel / HybridModel, one per virtual stage
            self._load()
        except BaseException:
            self.close()
            raise
        for chunk in self.chunks:
            chunk.eval()

    def _load(self) -> None:
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint import CheckpointException

        from megatron_siamese.training.checkpoint import last_line, sharded_model_state
        from megatron_siamese.training.checkpoint_files import damaged_shards, instead

        state = sharded_model_state(self.chunks)
        try:
            loaded = dist_checkpointing.load(state, self.checkpoint)
        except (Exception, CheckpointException) as error:
            damaged = damaged_shards(self.checkpoint)
            if damaged:
                raise CheckpointError(f"cannot load {self.checkpoint}: {damaged[0]} is corrupt; "
                                      f"{instead(self.checkpoint)}") from None
            raise CheckpointError(f"cannot load the weights of {self.checkpoint} into a {self.settings.model} model "
                                  f"with --norm {self.settings.norm} ({type(error).__name__}: "
                                  f"{last_line(error)[:300]}); are its model settings the checkpoint's?") from None
        for key, chunk in zip(state, self.chunks):
            chunk.load_state_dict(loaded[key])

    def close(self) -> None:
        """Tear down the process groups the session set up (the next session or run builds its own)."""
        from megatron.core import parallel_state

        if self._owns_groups:
            parallel_state.destroy_model_parallel()


def _groups_for(layout: Layout) -> bool:
    """Whether Megatron's process groups are up, for ``layout`` (another layout's: ValueError)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return False
    here = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
    if here != (layout.tp, layout.pp):
        raise ValueError(f"Megatron's process groups are up for tp{here[0]} x pp{here[1]}, not for the session's "
                         f"layout {layout.name}: close the other session or run first")
    return True


def open_session(checkpoint: str, layout: Layout = Layout(), settings: Optional[ModelSettings] = None,
                 seed: int = 1234, with_mtp: bool = True, **changes) -> ModelSession:
    """On each rank of a job: this rank's chunks of the model in ``checkpoint`` under ``layout``. ``settings``:
    for a checkpoint that records none; ``changes``: settings the weights do not depend on (``model_settings``)."""
    saved = read_checkpoint(checkpoint)
    chosen = model_settings(saved, settings, **changes)
    problems = layout_problems(chosen, layout, torch.distributed.get_world_size(), saved.vocab_size)
    if problems:
        from megatron_siamese.runtime.registry import ConfigError

        raise ConfigError(problems)
    return ModelSession(saved, chosen, layout, seed, with_mtp)


