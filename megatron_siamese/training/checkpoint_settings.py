"""The run's settings inside its checkpoints, and what a resume may change.

Every checkpoint's common state holds the run's ``TrainArgs`` as a plain dict under
``SETTINGS_KEY`` (as Megatron-LM keeps its args there). On ``--load``, before any rank
starts, the settings that make the model must be the checkpoint's: every ``ModelSettings``
field except those whose definition says ``resumable`` (kernels, FP8, the init of weights the
checkpoint replaces). The rest may change: the layout (TP, PP, virtual stages, DP, SP,
recompute), the batch and schedule (with the override flags, ``preflight.py``), data, logging
and output. Where the optimizer state cannot follow a layout change (``optimizer_problem``)
the run is refused with what to do instead.

Checkpoints written before the settings were stored load as before (their settings are
unknown, nothing is compared). Plain data, no torch import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional

from megatron_siamese.runtime.registry import Setting, definitions
from megatron_siamese.runtime.settings import ModelSettings
from megatron_siamese.training import checkpoint_files

SETTINGS_KEY = "megatron_siamese_settings"


def recorded(args) -> dict:
    """The settings a checkpoint stores: every field of ``args`` (plain values: JSON-able)."""
    return dataclasses.asdict(args)


def model_fields() -> List[str]:
    """The settings a checkpoint's weights depend on: ModelSettings' fields not marked resumable."""
    return [name for name, definition in definitions(ModelSettings).items() if not definition.resumable]


# settings whose unset value means a derived one (runtime/gpt.py): compared by what they mean
_EFFECTIVE = {
    "ffn_hidden_size": lambda values: values.get("ffn_hidden_size") or 4 * values.get("hidden_size", 0),
    "num_query_groups": lambda values: values.get("num_query_groups") or values.get("num_attention_heads"),
}


def _effective(values: Mapping[str, Any], name: str) -> Any:
    return _EFFECTIVE[name](values) if name in _EFFECTIVE else values.get(name)


def _shown(definition: Setting, value: Any) -> str:
    """A value as its flag says it: on/off for switches, 'unset' for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        given = (not value) if definition.action == "store_false" else value
        return "on" if given else "off"
    return str(value)


def model_differences(saved: Mapping[str, Any], args) -> List[str]:
    """``--flag saved -> this run's`` for each setting the model depends on that differs (a setting
    the checkpoint does not record, from an older version, is not compared)."""
    mine = recorded(args)
    # a GPTModel's weights load into a HybridModel through Megatron's own translation, which
    # matches the layers itself (checkpoint.py)
    translated = ("model", "hybrid_layer_pattern", "num_layers")
    skipped = translated if (saved.get("model"), mine["model"]) == ("gpt", "hybrid") else ()
    found = []
    for name in (name for name in model_fields() if name not in skipped):
        before, now = _effective(saved, name), _effective(mine, name)
        if name not in saved or before == now:
            continue
        definition = definitions(ModelSettings)[name]
        found.append(f"{definition.flags[0] if definition.flags else name} "
                     f"{_shown(definition, before)} -> {_shown(definition, now)}")
    return found


def model_problem(checkpoint: str, common: Mapping[str, Any], args) -> Optional[str]:
    """One line refusing to load ``checkpoint`` into another model (None: the same model, or a
    checkpoint that does not say)."""
    saved = common.get(SETTINGS_KEY)
    if not isinstance(saved, Mapping):
        return None
    differ = model_differences(saved, args)
    if not differ:
        return None
    return (f"--load {checkpoint} holds another model than this run builds ({', '.join(differ)}; "
            "checkpoint -> this run): give the checkpoint's values, or start without --load")


# the distributed optimizer's checkpoint formats that follow a TP/PP change (the others: DP only)
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")


def _fused_adam_here() -> bool:
    """Whether apex or Transformer Engine is installed: then the distributed optimizer saves and
    loads "fully_reshardable" state (``checkpoint.distributed_optimizer_format``), which Megatron
    documents as loading across TP/PP and the optimizer kind (not verifiable on CPU, so not refused)."""
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("apex", "transformer_engine"))


def _optimizer_kind(distributed: bool) -> str:
    return "the distributed optimizer's" if distributed else "the plain optimizer's"


def optimizer_problem(checkpoint: str, common: Mapping[str, Any], args) -> Optional[str]:
    """One line when the checkpoint's optimizer state cannot follow this run's layout (None: it
    can, or none is loaded). Found on megatron-core 0.16.1 and 0.19.2 with torch's Adam (no
    apex, no Transformer Engine): the plain and the distributed optimizer cannot load each
    other's state (either format), and the distributed optimizer's "dp_reshardable" state
    reshards over DP only (its "fully_reshardable" loader fails there too: ``checkpoint.py``)."""
    if args.no_load_optim or not checkpoint_files.brings_training_state(common, args.model):
        return None  # weights only
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, Mapping):
        return None
    sharding = optimizer.get("param_state_sharding_type")  # only the distributed optimizer's state has one
    weights_only = "or pass --no-load-optim (the weights and step, a fresh optimizer)"
    reshardable = sharding in FULLY_RESHARDABLE or (sharding is None and _fused_adam_here())
    if (sharding is not None) != bool(args.distributed_optimizer) and not reshardable:
        flag = "with" if sharding is not None else "without"
        return (f"--load {checkpoint} holds {_optimizer_kind(sharding is not None)} state, which "
                f"{_optimizer_kind(args.distributed_optimizer)[:-2]} cannot load: resume {flag} "
                f"--use-distributed-optimizer, {weights_only}")
    saved = common.get(SETTINGS_KEY)
    if sharding is None or sharding in FULLY_RESHARDABLE or not isinstance(saved, Mapping):
        return None
    layout = [(flag, saved.get(name), getattr(args, name)) for name, flag in
              (("tp", "--tp"), ("pp", "--pp"), ("vpp", "--vpp"))]
    if all(before == now for _, before, now in layout):
        return None
    at = " ".join(f"{flag} {before}" for flag, before, _ in layout if before is not None)
    return (f"--load {checkpoint} holds the distributed optimizer's state in the {sharding!r} format, which "
            f"reshards over --dp only: resume at the saved {at} (any --dp), {weights_only}")
