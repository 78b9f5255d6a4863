"""The model settings inside a checkpoint, and which of them another run may change.

A model-only checkpoint of ours holds its ``TrainArgs`` as a dict under ``SETTINGS_KEY`` (Megatron-LM's
loop keeps its ``args``). On ``--load`` every ``ModelSettings`` field must be the checkpoint's except
those defined ``resumable`` (kernels, FP8, init, MoE loss coefficients, balancing and dispatcher); the
layout, batch, schedule and data may change (dist_checkpointing reshards). Checkpoints without stored
settings are not compared. Plain data, no torch import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional

from megatron_siamese.runtime.registry import Setting, definitions
from megatron_siamese.runtime.settings import ModelSettings, moe_layer_freq

SETTINGS_KEY = "megatron_siamese_settings"


def recorded(args) -> dict:
    """The settings a checkpoint stores: every field of ``args`` (plain values: JSON-able)."""
    return dataclasses.asdict(args)


def model_fields() -> List[str]:
    """The settings a checkpoint's weights depend on: ModelSettings' fields not marked resumable."""
    return [name for name, definition in definitions(ModelSettings).items() if not definition.resumable]


def _ffn_hidden_size(values: Mapping[str, Any]) -> Any:
    return values.get("ffn_hidden_size") or 4 * values.get("hidden_size", 0)


def _moe_layers(values: Mapping[str, Any]) -> Any:
    """``--moe-layer-freq`` as the 0/1 per layer it means (``2`` is ``[1,0,1,0]`` at 4 layers)."""
    text = values.get("moe_layer_freq")
    if text is None or values.get("num_moe_experts") is None:
        return text
    try:
        pattern = moe_layer_freq(str(text))
    except ValueError:
        return text
    return [int(layer % pattern == 0) for layer in range(values.get("num_layers", 0))] if isinstance(
        pattern, int) else pattern


# settings whose unset value (or spelling) means a derived one (runtime/gpt.py): compared by what they mean
_EFFECTIVE = {
    "ffn_hidden_size": _ffn_hidden_size,
    "num_query_groups": lambda values: values.get("num_query_groups") or values.get("num_attention_heads"),
    "moe_ffn_hidden_size": lambda values: values.get("moe_ffn_hidden_size") or (
        _ffn_hidden_size(values) if values.get("num_moe_experts") is not None else None),
    "moe_layer_freq": _moe_layers,
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


def model_problem(checkpoint: str, common: Mapping[str, Any], args, flags_describe: bool = False) -> Optional[str]:
    """One line refusing to load ``checkpoint`` into another model (None: the same, or it does not say).
    ``flags_describe``: a command whose flags describe the saved model, not a run that builds one."""
    saved = common.get(SETTINGS_KEY)
    if not isinstance(saved, Mapping):
        return None
    differ = model_differences(saved, args)
    if not differ:
        return None
    if flags_describe:
        return (f"--load {checkpoint} holds another model than the flags describe ({', '.join(differ)}; "
                "checkpoint -> flags): give the checkpoint's model flags")
    return (f"--load {checkpoint} holds another model than this run builds ({', '.join(differ)}; "
            "checkpoint -> this run): give the checkpoint's values, or start without --load")
