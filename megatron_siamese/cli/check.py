"""``megatron-siamese check``: every parallel layout against one rank (check/command.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from typing import Dict, List, Optional, Tuple

from megatron_siamese.check import DEFAULT_LAYOUTS, MOE_LAYOUTS, SPECS
from megatron_siamese.check.case import ModelCase
from megatron_siamese.check.faults import FAULTS, acted_nowhere
from megatron_siamese.cli.flags import HelpFormatter, add_setting
from megatron_siamese.runtime.divisibility import expert_problems, layout_part, shape_problems, split_problems
from megatron_siamese.runtime.layout import Layout, parse_layout
from megatron_siamese.runtime.registry import definitions, field_problems
from megatron_siamese.runtime.settings import ModelSettings, model_class_problems, scheme_setting_problems
from megatron_siamese.training.args import ConfigError

DESCRIPTION = """\
Prove on your own machines that every parallel layout computes what one device computes.

Every layout builds the same GPT from global-name-seeded weights, runs one training step of
the same global batch through Megatron's schedules, finalize_model_grads and optimizer, and
is compared against a single-rank run: every per-microbatch loss, every gradient and every
parameter after the step. One row per layout; the exit status is 1 (on every rank) if any
layout fails.

Run here, it starts the ranks itself (gloo on CPU, NCCL when CUDA is present), as many as the
largest layout needs. Under torchrun (srun torchrun on SLURM), across nodes, the job's ranks
run it: layouts smaller than the job use its first ranks while the others wait, and --layouts
all picks every layout that fits the job (docs/parallelism.md, "On a cluster"):

  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m megatron_siamese.cli check --layouts all --bf16 --json check.json

Layout names: sizes tpN, ppN, vppN (virtual stages per pipeline rank), cpN, dpN, epN / etpN
(expert parallel / expert tensor parallel: MoE layers; ep takes the smallest DP that holds it)
and flags sp (sequence parallel), do (distributed optimizer), full / sel (full / selective
recompute), fsdp2 (torch FSDP2) / mfsdpN (Megatron-FSDP, sharding strategy N: 0 no_shard,
1 optim, 2 optim_grads, 3 optim_grads_params), joined by '-'; 'single' is one rank.
Example: tp2-pp2-sp, tp2-ep2-sp, tp2-dp2-sp-fsdp2.

Mixture-of-experts: --num-experts N checks MoE layers (every other layer by default:
--moe-layer-freq) against one rank under the MoE matrix (expert parallelism with TP, PP, DP
and the distributed optimizer), expert parameters compared per global expert:

  megatron-siamese check --num-experts 4 --disable-bias-linear
"""

# the model settings the check takes, as train and plan define them, with the check's tiny defaults
CASE_SETTINGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "seq_length", "normalization", "add_bias_linear", "qk_layernorm", "model", "hybrid_layer_pattern", "dtype",
                 "transformer_impl", "fp8", "fp8_recipe",
                 # the schemes' own settings (the ablations, Mix-LN's split, HybridNorm*)
                 "siamese_input_norm", "siamese_depth_scale", "mix_ln_alpha", "hybridnorm_star",
                 # mixture of experts
                 "num_moe_experts", "moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                 "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_grouped_gemm",
                 # multi-latent attention, multi-token prediction
                 "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "rope_type", "rotary_scaling_factor", "mtp_num_layers", "mtp_loss_scaling_factor")
# grouped-query attention unless multi-latent attention (which has no groups): the check's default then
GROUPS_UNLESS_MLA = "num_query_groups"
# the check's own sizes (its data: random tokens of a vocabulary, a fixed global batch)
SIZES = ("vocab_size", "micro_batch_size", "num_microbatches", "seed")
CASE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelCase)}


def add_case_flags(parser: argparse.ArgumentParser) -> None:
    settings = definitions(ModelSettings)
    group = parser.add_argument_group("model and precision (Megatron-LM's flag names; defaults: the check's tiny GPT)")
    for name in CASE_SETTINGS:
        # train's own default, where its help names one, is not the check's
        help = re.sub(r" \(\)", "", re.sub(r"(; )?default: [^)]*\)", ")", settings[name].help))
        default = CASE_DEFAULTS[name]
        if name == GROUPS_UNLESS_MLA:  # left unset: the check's groups, or none under MLA (run())
            help, default = f"{help} (default: {default}; none with --multi-latent-attention)", argparse.SUPPRESS
        add_setting(group, dataclasses.replace(settings[name], default=default, help=help))
    data = parser.add_argument_group("data")
    for name in SIZES:
        data.add_argument("--" + name.replace("_", "-"), type=int, default=CASE_DEFAULTS[name],
                          help="the global batch: --num-microbatches of --micro-batch-size random sequences over "
                               "--vocab-size tokens, from --seed" if name == "vocab_size" else "see --vocab-size")
    data.add_argument("--packed-sequences", action="store_true",
                      help="packed (THD) microbatches: each sequence three documents (a quarter, a half, a quarter "
                           "of --seq-length), a microbatch's sequences one row, each document attending only to "
                           "itself (Megatron's PackedSeqParams)")


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="every parallel layout against one rank", description=DESCRIPTION,
                                 formatter_class=HelpFormatter)
    parser.add_argument("--layouts", default=None,
                        help="comma-separated layout names, or 'all': every layout that fits the job (the CPU "
                             "matrix's, and splits of the whole launched job into tp x pp x dp); default: the CPU "
                             f"matrix ({','.join(DEFAULT_LAYOUTS)}), with --num-experts the MoE matrix "
                             f"({','.join(MOE_LAYOUTS)})")
    parser.add_argument("--spec", choices=sorted(SPECS), default="siamese",
                        help="siamese: SiameseNorm via the Python API; siamese-layer: via the layer spec object "
                             "Megatron-LM's --spec imports; siamese-hybrid: the authors' hybrid variant; post, "
                             "hybridnorm, mixln: the single-stream baselines (Post-Norm, HybridNorm, Mix-LN); stock: "
                             "Megatron's Pre-Norm layer, as a control for the check itself")
    parser.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                        help="how long a rank waits for the others (joining, a collective, a layout it sits out) "
                             "before the whole check fails")
    add_case_flags(parser)
    for action in parser._actions:  # the model settings' help names train's scheme flag; here it is --spec
        if action.help and "--norm " in action.help:
            action.help = action.help.replace("--norm ", "--spec ")
    parser.add_argument("--plant-fault", choices=sorted(FAULTS), default=None,
                        help="plant a known bug on every rank to see the check fail")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--list", action="store_true",
                        help="print the layouts --layouts picks (with 'all': those that fit this job and model) and exit")
    return parser


def problems(case: ModelCase, layouts: List[str]) -> List[str]:
    """What keeps the check from running (one line each), found before any rank starts."""
    found = [problem for name, problem in field_problems(case, ModelSettings).items() if name in CASE_SETTINGS]
    found += [f"--{field.replace('_', '-')} must be at least 1 (got {getattr(case, field)})"
              for field in SIZES if field != "seed" and getattr(case, field) < 1]
    if found:
        return found
    found += model_class_problems(case)
    found += scheme_setting_problems(case, "--spec", {norm: spec for spec, norm in SPECS.items()})
    found += shape_problems(case)
    for name in layouts:
        try:
            layout = parse_layout(name)
        except ValueError as error:
            found.append(f"--layouts: {error}")
            continue
        found += [f"layout {name}: {problem}" for problem in _split_problems(case, layout)]
    # the single-rank run every layout is compared with must train the experts too
    found += [f"the single-rank run: {problem}" for problem in expert_problems(case, Layout(), layout_part)]
    return found


def _split_problems(case: ModelCase, layout: Layout) -> List[str]:
    return split_problems(case, layout, vocab_size=case.vocab_size, micro_batch_size=case.micro_batch_size,
                          global_batch_size=case.micro_batch_size * case.num_microbatches,
                          global_batch_flag="--micro-batch-size x --num-microbatches =",
                          spell=layout_part) + packed_problems(case, layout)


def packed_problems(case: ModelCase, layout: Layout) -> List[str]:
    """What keeps ``--packed-sequences`` from cutting the check's sequences into documents that
    ``layout`` can split (each document into 2 x cp chunks under context parallelism)."""
    if not case.packed_sequences:
        return []
    if case.mtp_num_layers:
        return ["--packed-sequences with --mtp-num-layers: multi-token prediction's rolled labels would cross "
                "documents; check MTP without packing"]
    quarter, cp = case.seq_length // 4, layout.cp
    if case.seq_length % 4 or quarter % (2 * cp):
        return [f"--packed-sequences cuts each --seq-length {case.seq_length} sequence into documents of a quarter, "
                f"a half and a quarter{', each cut into 2 x cp chunks' if cp > 1 else ''}: use a --seq-length that "
                f"is a multiple of {8 * cp if cp > 1 else 4}"]
    return []


def fit_problems(layouts: List[str], world: Optional[int]) -> List[str]:
    """Layouts a launched job of ``world`` ranks cannot run (spawned here, the check starts
    as many ranks as the largest layout needs)."""
    if world is None:
        return []
    too_big = [name for name in layouts if _parses(name) and parse_layout(name).world_size > world]
    return [f"layout {name} needs {parse_layout(name).world_size} ranks but the launched job has {world}: launch more "
            "ranks, drop it, or pass --layouts all for every layout that fits" for name in too_big]


def _parses(name: str) -> bool:
    try:
        parse_layout(name)
    except ValueError:
        return False  # problems() says why
    return True


def engine_problems(case: ModelCase) -> List[str]:
    """Transformer Engine and FP8 asked for where they cannot run."""
    found = []
    if case.fp8 and case.transformer_impl != "transformer_engine":
        found.append("--fp8-format needs Transformer Engine's GEMMs: add --transformer-impl transformer_engine")
    if case.fp8 and case.dtype != "bf16":
        found.append("--fp8-format runs FP8 GEMMs in a bf16 model: add --bf16")
    if case.transformer_impl == "transformer_engine":
        from megatron_siamese import te

        reason = te.unavailable_reason()
        if reason:
            found.append(f"--transformer-impl transformer_engine: {reason}; use --transformer-impl local")
    return found


def chosen_layouts(requested: Optional[str], case: ModelCase,
                   world: Optional[int]) -> Tuple[List[str], Dict[str, str]]:
    """The layouts to run: those named (none: the model's CPU matrix) or, for ``all``, every candidate the
    job and the model admit; and the candidates left out, each with its first reason."""
    from megatron_siamese.check.matrix import cpu_matrix

    if requested is None:
        return list(cpu_matrix(case.num_moe_experts)), {}
    if requested.strip() != "all":
        return [name.strip() for name in requested.split(",") if name.strip()], {}
    from megatron_siamese.check.command import job_size
    from megatron_siamese.check.matrix import layouts_that_fit

    fits = world or job_size([parse_layout(name) for name in cpu_matrix(case.num_moe_experts)])
    reasons = {name: problems(case, [name]) for name in layouts_that_fit(fits, case.num_moe_experts)}
    return [name for name, found in reasons.items() if not found], {name: found[0] for name, found in reasons.items() if found}


def run(options: argparse.Namespace) -> int:
    from megatron_siamese.runtime import launchers

    given = {name: getattr(options, name) for name in CASE_SETTINGS + SIZES + ("packed_sequences",)
             if hasattr(options, name)}
    given.setdefault(GROUPS_UNLESS_MLA, None if given["multi_latent_attention"] else CASE_DEFAULTS[GROUPS_UNLESS_MLA])
    case = ModelCase(norm=SPECS[options.spec], **given)
    launch = launchers.detect()  # LaunchError: the launcher's variables contradict one another
    world = None if launch is None else launch.world_size
    layouts, left_out = chosen_layouts(options.layouts, case, world)
    if options.list:
        if launch is None or launch.rank == 0:
            print("\n".join(layouts))
        return 0
    found = problems(case, layouts) + fit_problems(layouts, world) + engine_problems(case)
    if not layouts:
        found.append(f"--layouts {options.layouts!r} leaves no layout to run")
    if found:
        raise ConfigError(found)
    from megatron_siamese.runtime.launch import start_rank_server

    start_rank_server()  # the ranks' imports overlap the check's below
    from megatron_siamese.check.command import HEADER, run_check, tolerance_of

    reporter = launch is None or launch.rank == 0
    if reporter:
        where = "spawned here" if launch is None else launch.describe()
        print(f"SiameseNorm parallel correctness check: spec={options.spec} model={case.model} dtype={case.dtype}"
              f"{f' fp8={case.fp8}/{case.fp8_recipe}' if case.fp8 else ''} impl={case.transformer_impl} "
              f"layers={case.num_layers} hidden={case.hidden_size} microbatches={case.num_microbatches}"
              f"{' packed (THD) documents ' + str(case.document_lengths) if case.packed_sequences else ''}; {where}")
        print(f"tolerance ({'fp8' if case.fp8 else case.dtype}): {tolerance_of(case).describe()}; "
              "errors shown are max|a-b| / max|ref|")
        if left_out:  # the model's sizes rule them out: say so, or a user may think them checked
            print(f"--layouts all leaves out {len(left_out)}: " + "; ".join(
                f"{name} ({reason.split(': ', 1)[-1]})" for name, reason in left_out.items()))
        print(HEADER, flush=True)
    start = time.perf_counter()
    rows = run_check(case, layouts, options.spec, fault=options.plant_fault,
                     timeout_s=options.distributed_timeout_minutes * 60)
    bad = [r for r in rows if r.status in ("FAIL", "ERROR")]
    if reporter:
        passed = sum(r.status == "PASS" for r in rows)
        skipped = sum(r.status == "SKIP" for r in rows)
        seconds = time.perf_counter() - start
        print(f"{passed} passed, {len(bad)} failed, {skipped} skipped in {seconds:.0f}s", flush=True)
        unacted = acted_nowhere(options.plant_fault, [row.status for row in rows])
        if unacted:
            print(unacted, file=sys.stderr, flush=True)
        if options.json:
            report = dict(spec=options.spec, case=dataclasses.asdict(case), launch=None if launch is None else
                          dataclasses.asdict(launch), tolerance=tolerance_of(case).describe(), seconds=seconds,
                          passed=not bad, left_out=left_out, rows=[dataclasses.asdict(r) for r in rows])
            with open(options.json, "w") as out:
                json.dump(report, out, indent=2)
    from megatron_siamese.runtime.job import synchronize

    synchronize()  # no rank exits (which lets a launcher stop the others) before rank 0 has written
    return 1 if bad else 0
