"""The run's settings inside its checkpoints, and what a resume may change.

Every checkpoint's common state holds the run's ``TrainArgs`` as a plain dict under
``SETTINGS_KEY`` (as Megatron-LM keeps its args there). On ``--load``, before any rank
starts, the settings that make the model must be the checkpoint's: every ``ModelSettings``
field except those whose definition says ``resumable`` (kernels, FP8, the init of weights the
checkpoint replaces; of mixture-of-experts, the aux-loss and z-loss coefficients and the
load-balancing type, which shape the training objective, and the token dispatcher, which only
moves tokens). The number of experts, top-k, the dense/MoE layer pattern and the expert widths
make another model and must be the checkpoint's. The rest may change: the layout (TP, PP,
virtual stages, DP, EP, expert TP, SP, recompute; dist_checkpointing reshards the experts as
it does every other weight), the batch and schedule (with the override flags,
``preflight.py``), data, logging and output. Where the optimizer state cannot follow a layout
change (``optimizer_problem``) the run is refused with what to do instead.

Checkpoints written before the settings were stored load as before (their settings are
unknown, nothing is compared). Plain data, no torch import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional

from megatron_siamese.runtime.registry import Setting, definitions
from megatron_siamese.runtime.settings import ModelSettings, moe_layer_freq
from megatron_siamese.training import checkpoint_files

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
    """One line refusing to load ``checkpoint`` into another model (None: the same model, or a
    checkpoint that does not say). ``flags_describe``: a command whose flags describe the saved
    model (generate, export, analyze, upcycle), not a run that builds one."""
    saved = common.get(SETTINGS_KEY)
    if not isinstance(saved, Mapping):
        return None
    differ = model_differences(saved, args)
    if not differ:
        return None
    if flags_describe:
        return (f"--load {checkpoint} holds another model than the flags describe ({', '.join(differ)}; "
                "checkpoint -> flags): give the checkpoint's model flags (its run's settings.json lists them)")
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
    optimizer = _optimizer_parts(common.get("optimizer"))[0]
    if not isinstance(optimizer, Mapping):
        return None
    sharding = optimizer.get("param_state_sharding_type")  # only the distributed optimizer's state has one
    weights_only = "or pass --no-load-optim (the weights and step, a fresh optimizer)"
    reshardable = sharding in FULLY_RESHARDABLE or (sharding is None and _fused_adam_here())
    if (sharding is not None) != bool(args.distributed_optimizer) and not reshardable:
        remedy = f"resume {'with' if sharding is not None else 'without'} --use-distributed-optimizer"
        if sharding is not None and args.use_torch_fsdp2:  # FSDP2 steps its shards with the plain optimizer
            remedy += " instead of --use-torch-fsdp2"
        return (f"--load {checkpoint} holds {_optimizer_kind(sharding is not None)} state, which "
                f"{_optimizer_kind(args.distributed_optimizer)[:-2]} cannot load: {remedy}, {weights_only}")
    saved = common.get(SETTINGS_KEY)
    if sharding is None or sharding in FULLY_RESHARDABLE or not isinstance(saved, Mapping):
        return None
    layout = [(flag, saved.get(name, default), getattr(args, name)) for name, flag, default in
              (("tp", "--tp", None), ("pp", "--pp", None), ("vpp", "--vpp", None), ("ep", "--ep", 1),
               ("etp", "--etp", None))]
    if all(before == now for _, before, now in layout):
        return None
    at = " ".join(f"{flag} {before}" for flag, before, _ in layout
                  if before is not None and not (flag == "--ep" and before == 1))
    return (f"--load {checkpoint} holds the distributed optimizer's state in the {sharding!r} format, which "
            f"reshards over --dp only: resume at the saved {at} (any --dp), {weights_only}")


def _optimizer_parts(optimizer: Any) -> List[Any]:
    """The saved state of each optimizer Megatron chains (``{0: dense, 1: experts}`` where it keeps
    expert-parallel parameters apart), or of the one optimizer."""
    if isinstance(optimizer, Mapping) and optimizer and all(isinstance(key, int) for key in optimizer):
        return [optimizer[key] for key in sorted(optimizer)]
    return [optimizer]


def optimizer_split_problem(checkpoint: str, common: Mapping[str, Any], optimizers: int, args) -> Optional[str]:
    """One line when the checkpoint's optimizer state is split otherwise than this run's
    ``optimizers`` (how many Megatron chains here): Megatron keeps the expert parameters in an
    optimizer of their own under expert parallelism (megatron-core 0.19 also when --etp differs
    from --tp), and the state of one such layout does not load into the other."""
    saved_optimizer = common.get("optimizer")
    if args.no_load_optim or saved_optimizer is None:
        return None
    saved = len(_optimizer_parts(saved_optimizer))
    if saved == optimizers:
        return None
    settings = common.get(SETTINGS_KEY)
    ep = settings.get("ep", 1) if isinstance(settings, Mapping) else None
    at = f" (saved at --ep {ep})" if ep is not None else ""
    if saved > optimizers:
        layouts = (f"holds the expert parameters' optimizer state apart from the others'{at}, which this run at "
                   f"--ep {args.ep} keeps in one optimizer: resume with expert parallelism (--ep 2 or more)")
    else:
        layouts = (f"holds one optimizer's state for all parameters{at}, which this run at --ep {args.ep} keeps "
                   "apart for the experts: resume at the checkpoint's --ep and --etp")
    return (f"--load {checkpoint} {layouts}, or pass --no-load-optim (the weights and step, a fresh optimizer)")
