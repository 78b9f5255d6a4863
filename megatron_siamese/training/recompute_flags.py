"""``train``'s recompute flags (Megatron-LM's and the package's --recompute preset): what of them
Megatron refuses or this model cannot use, in the flags' words.
"""

from __future__ import annotations

from typing import List

from megatron_siamese.runtime.layout import RECOMPUTE_MODULES, recompute_problem

_RECOMPUTE_FLAGS = {"recompute_granularity": "--recompute-granularity", "recompute_method": "--recompute-method",
                    "recompute_num_layers": "--recompute-num-layers", "recompute_modules": "--recompute-modules"}


def problems(args) -> List[str]:
    """What of ``args``' recompute flags Megatron refuses, the installed megatron-core lacks, or has
    nothing to recompute in this model, in the flags' words."""
    from megatron_siamese.versions import installed_megatron_core, release

    if args.recompute != "none" and args.recompute_granularity is not None:
        return [f"--recompute {args.recompute} and --recompute-granularity {args.recompute_granularity} both say how "
                "to recompute: pass one (--recompute is the package's preset of Megatron-LM's flags)"]
    modules = args.recompute_modules or ()
    problem = recompute_problem(args.recompute_granularity, args.recompute_method, args.recompute_num_layers, modules,
                                spell=_RECOMPUTE_FLAGS.get)
    if problem:
        return [problem]
    recompute = args.recomputation
    found = []
    installed = installed_megatron_core()
    lacking = [module for module in recompute.modules if release(installed) < RECOMPUTE_MODULES[module]]
    if lacking:
        found.append(f"--recompute-modules {' '.join(lacking)}: megatron-core {installed} has no such module (it came "
                     f"in {'.'.join(map(str, RECOMPUTE_MODULES[lacking[0]]))}): drop it")
    pointless = {
        "moe": (not args.num_moe_experts, "MoE layers: add --num-experts N"),
        "moe_act": (not args.moe_grouped_gemm, "grouped-GEMM experts (Megatron's rule): add --moe-grouped-gemm"),
        "shared_experts": (not args.moe_shared_expert_intermediate_size,
                           "a shared expert: add --moe-shared-expert-intermediate-size"),
        "mla_up_proj": (True, "multi-latent attention's up-projections (Megatron's rule), which this model has not"),
        "gdn_norm_out": (args.model != "hybrid" or "G" not in (args.hybrid_layer_pattern or ""),
                         "a HybridModel's gated delta net ('G') layers"),
    }
    for module in recompute.modules:
        missing, what = pointless.get(module, (False, ""))
        if missing:
            found.append(f"--recompute-modules {module} recomputes {what}")
    if recompute.full and recompute.method == "uniform" and args.num_layers > 0:
        per_chunk = args.num_layers // (args.pp * (args.vpp or 1)) or args.num_layers
        if per_chunk % recompute.num_layers:
            found.append(f"--recompute-method uniform recomputes each model chunk's {per_chunk} layers in groups of "
                         f"--recompute-num-layers {recompute.num_layers}, which must divide them")
    return found
