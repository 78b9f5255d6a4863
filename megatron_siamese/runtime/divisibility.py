"""Whether a model's sizes fit together and split over a layout: each rule written once.

Applied by ``training/args.py`` and ``cli/check.py`` before any rank starts; each problem is one line
naming the flag to change. Sizes below 1 are skipped: the callers refuse those themselves.
"""

from __future__ import annotations

from typing import Callable, List

from megatron_siamese.hybrid_pattern import hybrid_pattern
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.settings import ModelSettings, moe_layer_freq


def short_flag(key: str, value: int) -> str:
    """A layout size as the train command's short flags name it: ``--tp 2``."""
    return f"--{key} {value}"


def layout_part(key: str, value: int) -> str:
    """A layout size as a layout name spells it: ``tp2``."""
    return f"{key}{value}"


def _add_sequence_parallel(spell: Callable[[str, int], str]) -> str:
    return "add it ('sp' in the layout's name)" if spell is layout_part else "add it (--sp)"


def _positive(*sizes) -> bool:
    return all(size is not None and size >= 1 for size in sizes)


def shape_problems(model: ModelSettings) -> List[str]:
    """The model's own sizes that do not fit together, whatever the layout."""
    found = []
    heads, groups = model.num_attention_heads, model.num_query_groups
    if _positive(model.hidden_size, heads) and model.hidden_size % heads:
        found.append(f"--hidden-size {model.hidden_size} is not a multiple of --num-attention-heads {heads}: "
                     "change one of them")
    if _positive(heads, groups) and heads % groups:
        found.append(f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
    return found + _moe_shape_problems(model) + _mla_problems(model) + _mtp_problems(model)


_MLA_ONLY = (("q_lora_rank", "--q-lora-rank"), ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"),
             ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"), ("v_head_dim", "--v-head-dim"),
             ("rope_type", "--rope-type"), ("rotary_scaling_factor", "--rotary-scaling-factor"))
_STANDARD_ATTENTION_ONLY = ("siamese-hybrid", "post", "hybridnorm", "mixln")  # schemes built on standard attention


def _given(model: ModelSettings, flags) -> List[str]:
    """The flags of ``flags`` ((field, flag) pairs) set to other than the command's own defaults."""
    defaults = type(model).__dataclass_fields__  # the command's own (the check's differ from train's)
    return [flag for name, flag in flags if getattr(model, name) != defaults[name].default]


def _mla_problems(model: ModelSettings) -> List[str]:
    if not model.multi_latent_attention:
        given = _given(model, _MLA_ONLY)
        return [f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} multi-latent attention: add "
                "--multi-latent-attention"] if given else []
    found = []
    if model.num_query_groups is not None:
        found.append("--multi-latent-attention has no key/value head groups (Megatron-LM refuses grouped-query "
                     "attention with it): leave out --num-query-groups")
    if model.position_embedding_type != "rope":
        found.append("--multi-latent-attention applies RoPE inside its attention: use --position-embedding-type rope")
    if model.norm in _STANDARD_ATTENTION_ONLY:
        found.append(f"--multi-latent-attention with the {model.norm} scheme: it is built on standard attention; use "
                     "siamese, siamese-layer or pre")
    if model.model == "hybrid":
        found.append("--multi-latent-attention: the HybridModel stacks here build standard attention; use --model gpt")
    return found


def _mtp_problems(model: ModelSettings) -> List[str]:
    if model.mtp_num_layers is None:
        given = _given(model, (("mtp_loss_scaling_factor", "--mtp-loss-scaling-factor"),))
        return [f"{given[0]} weighs multi-token prediction's losses: add --mtp-num-layers N"] if given else []
    found = []
    if model.position_embedding_type != "rope":  # Megatron-LM's rule: its layers roll the token ids, not positions
        found.append("--mtp-num-layers needs --position-embedding-type rope (Megatron-LM's rule)")
    if model.norm in _STANDARD_ATTENTION_ONLY[1:]:
        found.append(f"--mtp-num-layers with the {model.norm} baseline: its MTP layers would be stock layers after "
                     "the baseline's; use siamese, siamese-layer or pre")
    if model.model == "hybrid":
        found.append("--mtp-num-layers: multi-token prediction is built for GPTModel here; use --model gpt")
    return found


_MOE_ONLY = (("moe_layer_freq", "--moe-layer-freq"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
             ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
             ("moe_z_loss_coeff", "--moe-z-loss-coeff"), ("moe_grouped_gemm", "--moe-grouped-gemm"),
             ("moe_router_topk", "--moe-router-topk"), ("moe_router_pre_softmax", "--moe-router-pre-softmax"))


def _moe_shape_problems(model: ModelSettings) -> List[str]:
    experts = model.num_moe_experts
    if model.model == "hybrid":
        has_moe = "E" in hybrid_pattern(model).layers
        if has_moe and experts is None:
            return ["the hybrid pattern's 'E' layers are MoE layers: add --num-experts N"]
        if experts is not None and not has_moe:
            return ["--num-experts sizes the hybrid pattern's MoE ('E') layers, and the pattern has none: "
                    "add 'E' layers to --hybrid-layer-pattern or leave --num-experts out"]
        if model.moe_layer_freq != type(model).__dataclass_fields__["moe_layer_freq"].default:
            return ["--moe-layer-freq places a GPT's MoE layers; in a HybridModel the pattern's 'E' does: leave it out"]
    if experts is None:
        given = _given(model, _MOE_ONLY)
        return [f"{', '.join(given)} configure{'s' if len(given) == 1 else ''} MoE layers: add --num-experts N"] if given else []
    found = []
    if _positive(experts, model.moe_router_topk) and model.moe_router_topk > experts:
        found.append(f"--moe-router-topk {model.moe_router_topk} routes to more experts than --num-experts {experts}")
    if model.moe_router_topk == 1 and not model.moe_router_pre_softmax:  # Megatron's rule
        found.append("--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over the one chosen expert "
                     "has no gradient)")
    if model.add_bias_linear and not model.moe_grouped_gemm:
        found.append("--add-bias-linear with MoE layers: Megatron's SequentialMLP experts cannot train with "
                     "biases (they add the bias in place into a view autograd protects): add --disable-bias-linear")
    try:
        pattern = moe_layer_freq(model.moe_layer_freq)
    except ValueError:
        return found  # refused by the setting's own check
    if model.norm == "siamese-layer" and pattern != 1:
        found.append("--norm siamese-layer builds every layer from one --spec object (with experts: "
                     "siamese_moe_layer_spec, an MoE layer each): use --moe-layer-freq 1, or --norm siamese")
    if isinstance(pattern, list) and model.model != "hybrid" and len(pattern) != model.num_layers:
        found.append(f"--moe-layer-freq lists {len(pattern)} layers for --num-layers {model.num_layers}: "
                     "give one 0/1 per layer")
    return found


def split_problems(model: ModelSettings, layout: Layout, *, vocab_size: int, micro_batch_size: int,
                   global_batch_size: int, global_batch_flag: str = "--global-batch-size",
                   spell: Callable[[str, int], str] = short_flag, training: bool = True) -> List[str]:
    """What of ``model`` and its batch does not split over ``layout`` (TP, pipeline stages, experts,
    CP, FSDP, the global batch). ``spell`` names a layout size; ``training=False`` leaves out gradient rules."""
    found = []
    tp, heads, groups = layout.tp, model.num_attention_heads, model.num_query_groups
    if _positive(tp, heads) and heads % tp:
        found.append(f"--num-attention-heads {heads} does not split over {spell('tp', tp)}: use a tensor-parallel "
                     "size that divides the head count")
    elif _positive(tp, groups) and groups % tp:
        found.append(f"--num-query-groups {groups} does not split over {spell('tp', tp)}: use a tensor-parallel "
                     "size that divides it")
    ffn = model.mlp_width
    if _positive(tp, ffn) and ffn % tp:
        found.append(f"the MLP width {ffn} (--ffn-hidden-size) does not split over {spell('tp', tp)}: use a "
                     "tensor-parallel size that divides it, or a width that is a multiple of it")
    if training and model.multi_latent_attention and tp > 1 and not layout.sp:  # its duplicated down projections
        found.append(f"--multi-latent-attention under tensor parallelism ({spell('tp', tp)}) needs sequence "
                     "parallelism: its down projections are duplicated over TP, and their gradients are summed over "
                     f"TP only under SP; {_add_sequence_parallel(spell)}")
    if _positive(tp, vocab_size) and vocab_size % tp:
        divisors = ", ".join(str(d) for d in range(1, 17) if vocab_size % d == 0)
        found.append(f"the vocabulary ({vocab_size}) does not split over {spell('tp', tp)}: use a tensor-parallel "
                     f"size dividing it ({divisors}, ...)")
    found += _stage_problems(model, layout, spell)
    found += expert_problems(model, layout, spell)
    found += context_problems(model, layout, spell)
    found += fsdp_problems(layout)
    dp = layout.dp
    if _positive(micro_batch_size, global_batch_size, dp) and global_batch_size % (micro_batch_size * dp):
        found.append(f"{global_batch_flag} {global_batch_size} must be a multiple of --micro-batch-size x "
                     f"{spell('dp', dp)} = {micro_batch_size * dp}")
    return found


def context_problems(model: ModelSettings, layout: Layout, spell: Callable[[str, int], str] = short_flag) -> List[str]:
    """What of ``model``'s sequence ``layout``'s context parallelism cannot split (part of ``split_problems``)."""
    cp, seq = layout.cp, model.seq_length
    if cp == 1:
        return []
    found = []
    if _positive(seq) and seq % (2 * cp):
        found.append(f"--seq-length {seq} must be a multiple of 2 x {spell('cp', cp)} = {2 * cp} (context "
                     "parallelism cuts each sequence into 2 x cp chunks, two per rank)")
    elif layout.sp and _positive(seq) and (seq // cp) % layout.tp:
        found.append(f"each CP rank's {seq // cp} tokens (--seq-length {seq} / {spell('cp', cp)}) must split over "
                     f"{spell('tp', layout.tp)} under sequence parallelism: use a sequence length that is a multiple "
                     f"of {2 * cp * layout.tp}")
    if model.mtp_num_layers is not None:
        found.append(f"--mtp-num-layers under context parallelism ({spell('cp', cp)}): multi-token prediction rolls "
                     "its labels across the CP ranks' chunks and scores each rank's share apart, which is not the "
                     "one-rank loss (Megatron's own MTP too); train it without CP")
    return found


def expert_problems(model: ModelSettings, layout: Layout, spell: Callable[[str, int], str] = short_flag) -> List[str]:
    """What of ``model``'s MoE layers ``layout`` cannot split or train (part of ``split_problems``)."""
    experts = model.num_moe_experts
    if experts is None:
        return ([f"expert parallelism ({spell('ep', layout.ep)}) splits MoE layers: add --num-experts N"]
                if layout.ep > 1 else [])
    found = []
    if layout.tp > 1 and not layout.sp:  # Megatron's rule (TransformerConfig refuses it on the ranks)
        found.append(f"MoE layers under tensor parallelism ({spell('tp', layout.tp)}) need sequence parallelism: "
                     f"{_add_sequence_parallel(spell)}")
    if _positive(experts, layout.ep) and experts % layout.ep:
        found.append(f"--num-experts {experts} does not split over {spell('ep', layout.ep)}: use an expert-parallel "
                     "size that divides the expert count")
    width = model.expert_width
    if _positive(width, layout.expert_tp) and width % layout.expert_tp:
        found.append(f"the expert MLP width {width} (--moe-ffn-hidden-size) does not split over "
                     f"{spell('etp', layout.expert_tp)}: use an expert tensor-parallel size that divides it, or a "
                     "width that is a multiple of it")
    return found


# Megatron-FSDP strategies megatron-core 0.16.x cannot train (fixed by 0.19): the call that fails, and how
_MEGATRON_FSDP_016 = {
    "no_shard": "its start_param_sync gathers a weight bucket that no_shard never allocates "
                "(megatron_fsdp.py:1126 -> param_and_grad_buffer.py:3734: 'NoneType' object has no attribute "
                "'fetch_bucket')",
    "optim": "with overlap_grad_reduce it reduce-scatters each gradient bucket and adds the result to a buffer "
             "that still holds this rank's own gradient (param_and_grad_buffer.py:3257: every gradient off by "
             "up to 1.8x in the check)",
}


def fsdp_problems(layout: Layout) -> List[str]:
    """Fully sharded data parallelism the installed megatron-core cannot train (part of ``split_problems``)."""
    if layout.fsdp != "megatron" or layout.fsdp_sharding not in _MEGATRON_FSDP_016:
        return []
    from megatron_siamese.versions import installed_megatron_core, release

    found = installed_megatron_core()
    if release(found) >= (0, 19, 0):
        return []
    return [f"Megatron-FSDP's {layout.fsdp_sharding} strategy cannot train on megatron-core {found}: "
            f"{_MEGATRON_FSDP_016[layout.fsdp_sharding]}; use --data-parallel-sharding-strategy optim_grads or "
            "optim_grads_params (layouts mfsdp2, mfsdp3), or megatron-core 0.19"]


def _stage_problems(model: ModelSettings, layout: Layout, spell: Callable[[str, int], str]) -> List[str]:
    if not _positive(layout.pp, model.num_layers, layout.vpp or 1):
        return []
    stages = layout.pp * (layout.vpp or 1)
    sizes = spell("pp", layout.pp) + (f" x {spell('vpp', layout.vpp)}" if layout.vpp else "")
    if model.model != "hybrid":
        if model.num_layers % stages:
            return [f"--num-layers {model.num_layers} does not split over {stages} pipeline stages ({sizes}): "
                    "use sizes whose product divides it"]
        return []
    pattern = hybrid_pattern(model)
    if pattern.has_boundaries and len(pattern.segments) != stages:
        return [f"--hybrid-layer-pattern has {len(pattern.segments)} pipeline segments ('|') for {stages} pipeline "
                f"stages ({sizes}): write one segment per stage"]
    if not pattern.has_boundaries and len(pattern.layers) % stages:
        return [f"the hybrid pattern's {len(pattern.layers)} layers do not split into {stages} pipeline stages "
                f"({sizes}): change them, or write the stage boundaries into --hybrid-layer-pattern with '|'"]
    return []
