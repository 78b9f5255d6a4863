"""``megatron-siamese plan`` on paper: its stock side equals Megatron-LM's own estimate where that
applies, SiameseNorm adds what its ops keep, the schedules' microbatches in flight, what data
parallelism shards (DDP, the distributed optimizer, FSDP), and the command (tables, refusals).
Pure arithmetic: tests/test_plan_measured.py holds the plan against CPU ranks."""

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from cli_runs import cli_here
from megatron_siamese.plan.activations import STOCK, layer_activations, tokens_of
from megatron_siamese.plan.args import PlanArgs, plan_inputs
from megatron_siamese.cli.plan import SETTINGS
from megatron_siamese.plan.gpus import GIB, gpu_memory
from megatron_siamese.plan.per_gpu import every_rank, gpu_costs, most_loaded
from megatron_siamese.plan.report import make_plan, micro_batches, with_micro_batch
from megatron_siamese.plan.schedule import in_flight
from megatron_siamese.plan.states import data_parallel_sharding
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.registry import ConfigError

pytestmark = pytest.mark.stack_independent


# -- the oracle: Megatron-LM's megatron/training/theoretical_memory_usage.py (tag core_v0.16.1),
# written out here (Megatron-LM is not in the megatron-core wheel) in the terms of its formulas


def megatron_lm_weight_and_optimizer_bytes(args: PlanArgs) -> float:
    """compute_weight_and_optimizer_memory: the most loaded shard's parameters (no biases, norms
    split over TP like the rest) at 18 bytes each, 6 + 12 / dp with the distributed optimizer."""
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups or heads
    gated = 3 / 2 if args.gated_linear_unit else 1
    norm = 1 if args.normalization == "RMSNorm" else 2
    attention = 2 * h * h * (1 + groups / heads) * (h // heads * heads / h)
    dense = 2 * h * (args.mlp_width * gated + norm) + attention
    moe_layers = 0
    if args.num_moe_experts:
        moe_layers = sum(layer % int(args.moe_layer_freq) == 0 for layer in range(args.num_layers))
    moe = 2 * h * (args.expert_width * (args.num_moe_experts or 1) * gated + norm) + attention
    embedding = h * args.padded_vocab
    block = dense * (args.num_layers - moe_layers) + moe * moe_layers + norm * h
    loaded = (block / args.pp + embedding) / args.tp
    if not args.share_embeddings_and_output_weights and args.pp == 1:
        loaded += embedding / args.tp
    return loaded * (6 + 12 / args.dp if args.distributed_optimizer else 18)


def megatron_lm_layer_activation_bytes(args: PlanArgs) -> float:
    """Korthikanti et al.'s Table 2 per layer: s b h (18 + 4 f / h) / t with sequence parallelism
    (compute_activation_memory), s b h (10 + 24 / t) without it (..._without_sp, f = 4h)."""
    sbh = args.seq_length * args.micro_batch_size * args.hidden_size
    if args.sp:
        return sbh * (18 + 4 * args.mlp_width / args.hidden_size) / args.tp
    return sbh * (10 + 24 / args.tp)


def megatron_lm_activation_bytes(args: PlanArgs) -> float:
    """compute_activation_memory (SP with selective recompute of the core attention): the first
    stage's layers and embedding over its in-flight microbatches, the head when there is one stage."""
    s, b, h, p = args.seq_length, args.micro_batch_size, args.hidden_size, args.pp
    found = megatron_lm_layer_activation_bytes(args) * args.tp * args.num_layers + 8 * s * b * p + s * b * h * p
    if args.vpp is not None:
        found *= 1 + (p - 1) / (p * args.vpp)
    elif p > 1:
        found *= min(1, args.num_microbatches / p)
    if p == 1:
        found += s * b * h * 4 * (1 + args.padded_vocab / h)
    return found / args.tp


# GPT-3 175B as Korthikanti et al. train it, in the setting Megatron-LM's estimate assumes: bf16,
# GELU, multi-head attention, learned positions (Q, K and V views of one stored projection), LayerNorm,
# no linear biases, dropout, flash attention (which keeps what selective recompute of the core
# attention keeps), stage outputs freed once sent
GPT3 = dict(num_layers=96, hidden_size=12288, num_attention_heads=96, ffn_hidden_size=4 * 12288, seq_length=2048,
            vocab_size=51200, gated_linear_unit=False, position_embedding_type="learned_absolute",
            normalization="LayerNorm", add_bias_linear=False, dtype="bf16",
            transformer_impl="transformer_engine", hidden_dropout=0.1, attention_dropout=0.1,
            deallocate_pipeline_outputs=True, micro_batch_size=1)
LAYOUTS = {  # Megatron-LM's estimate applies to each; layouts' global batches give the microbatches
    "tp8-pp8-dp16-sp": dict(tp=8, pp=8, dp=16, sp=True, global_batch_size=1536),
    "tp8-pp16-dp8-sp-do": dict(tp=8, pp=16, dp=8, sp=True, distributed_optimizer=True, global_batch_size=1536),
    "fewer microbatches than stages": dict(tp=8, pp=8, dp=2, sp=True, global_batch_size=4),
    "one stage, untied": dict(tp=8, dp=8, sp=True, global_batch_size=64, num_layers=32, hidden_size=4096,
                              num_attention_heads=32, ffn_hidden_size=16384, share_embeddings_and_output_weights=False),
}


def gpt3(**changes) -> PlanArgs:
    return PlanArgs(**{**GPT3, **changes})


def stock(args: PlanArgs):
    return every_rank(plan_inputs(args), STOCK)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stock_weights_gradients_and_optimizer_are_megatron_lms_estimate(name):
    """Within 1e-3, once the learned position embedding (whole on every TP rank of the first
    stage) Megatron-LM leaves out is taken off: it also splits the norms over TP and leaves out the
    distributed optimizer's buffer padding, both tiny at this size."""
    args = gpt3(**LAYOUTS[name])
    per_parameter = 6 + 12 / args.dp if args.distributed_optimizer else 18
    positions = args.seq_length * args.hidden_size * per_parameter
    planned = max(c.weights + c.grads + c.optimizer - positions * (c.rank == 0) for c in stock(args))
    assert planned == pytest.approx(megatron_lm_weight_and_optimizer_bytes(args), rel=1e-3)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stock_activations_of_the_first_stage_are_megatron_lms_estimate(name):
    """Within 2e-3: Megatron-LM leaves out the norms' statistics, flash attention's log-sum-exp,
    the position ids and the cross entropy's targets, and divides the token ids by TP."""
    args = gpt3(**LAYOUTS[name])
    first = stock(args)[0]
    assert first.activations + first.pipeline == pytest.approx(megatron_lm_activation_bytes(args), rel=2e-3)


def test_interleaved_activations_count_what_megatron_lms_penalty_averages():
    """Megatron-LM multiplies by 1 + (p - 1) / (p v); the plan counts the schedule's chunks in
    flight on rank 0 (the same 2 (p - 1) + (v - 1) p + 1 of them), whose embeddings that average
    does not place: within 1%."""
    args = gpt3(tp=8, pp=8, vpp=3, dp=4, sp=True, global_batch_size=256)
    first = stock(args)[0]
    assert first.activations + first.pipeline == pytest.approx(megatron_lm_activation_bytes(args), rel=1e-2)


@pytest.mark.parametrize("sp", [True, False])
def test_a_stock_layer_keeps_exactly_the_table_2_term_and_what_it_leaves_out(sp):
    """Per layer the plan is Megatron-LM's term plus, exactly, the norms' fp32 statistics and flash
    attention's log-sum-exp (with SP, f = 4h; without, Megatron-LM's 10 + 24 / t holds for f = 4h)."""
    args = gpt3(tp=8, sp=sp, dp=1, global_batch_size=8)
    inputs = plan_inputs(args)
    tokens = tokens_of(inputs.shape, inputs.layout, args.micro_batch_size)
    layer = layer_activations(inputs.shape, inputs.layout, tokens, inputs.impl, STOCK, layer=1)
    statistics = 2 * tokens.sharded * 4 * 2  # two LayerNorms, mean and rstd in fp32
    log_sum_exp = tokens.whole * args.num_attention_heads // args.tp * 4
    assert layer.total - statistics - log_sum_exp == megatron_lm_layer_activation_bytes(args)


def test_megatron_lms_weights_estimate_covers_moe_but_the_router():
    """An MoE model with experts split like the attention (EP 1): Megatron-LM's estimate less the
    routers' fp32 weights the plan counts (E h per MoE layer, whole on every rank)."""
    args = gpt3(tp=8, pp=8, dp=16, sp=True, global_batch_size=1536, num_moe_experts=8, moe_router_topk=2,
                moe_ffn_hidden_size=8192, moe_layer_freq="2")
    routers = args.num_layers // args.pp // 2 * args.num_moe_experts * args.hidden_size * (4 + 4 + 8)  # fp32: no main copy
    positions = args.seq_length * args.hidden_size * 18
    planned = max(c.weights + c.grads + c.optimizer - positions * (c.rank == 0) for c in stock(args))
    assert planned - routers == pytest.approx(megatron_lm_weight_and_optimizer_bytes(args), rel=1e-3)


# -- where SiameseNorm adds


def test_siamese_adds_per_layer_what_each_path_keeps():
    """Per layer and token, beyond stock (h-wide vectors of B bytes, S fp32 statistics per norm):
    joined h B + (56 - 2 S) (z and 14 statistics), apart 2 h B + (48 - 2 S) (each sublayer's packed
    input, 6 statistics each), PyTorch 4 h B + 4 S (docs/kernels.md's +1.02 / +2.02 / +4.01 vectors)."""
    args = gpt3(tp=1, dp=1, global_batch_size=1, num_layers=4, hidden_size=1024, num_attention_heads=8,
                ffn_hidden_size=4096, transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0)
    inputs = plan_inputs(args)
    tokens = tokens_of(inputs.shape, inputs.layout, 1)
    h, b, stats = 1024, 2, 4 * 2

    def added(path):
        layer = layer_activations(inputs.shape, inputs.layout, tokens, inputs.impl, path, layer=1)
        base = layer_activations(inputs.shape, inputs.layout, tokens, inputs.impl, STOCK, layer=1)
        return (layer.total - base.total) / tokens.whole

    assert added("joined") == h * b + 56 - 2 * stats
    assert added("apart") == 2 * h * b + 48 - 2 * stats
    assert added("pytorch") == 4 * h * b + 4 * stats


def test_siamese_pipeline_streams_are_twice_as_wide_and_the_rest_of_the_step_is_stock():
    args = gpt3(tp=8, pp=8, dp=16, sp=True, global_batch_size=1536)
    inputs = plan_inputs(args)
    for rank in range(args.pp):
        base, joined = gpu_costs(inputs, STOCK, rank), gpu_costs(inputs, "joined", rank)
        tied = 0 if rank not in (0, args.pp - 1) else args.padded_vocab // args.tp * args.hidden_size * 4
        assert joined.sent["pp"] - tied == 2 * (base.sent["pp"] - tied)
        assert joined.pipeline == 2 * base.pipeline
        assert joined.sent["sp"] == base.sent["sp"] and joined.sent["dp"] > base.sent["dp"]


# -- the schedules


@pytest.mark.parametrize("pp, microbatches", [(4, 8), (4, 2), (1, 3)])
def test_1f1b_keeps_min_of_stages_left_and_microbatches_in_flight(pp, microbatches):
    layout = Layout(pp=pp)
    for rank in range(pp):
        assert max(sum(moment) for moment in in_flight(layout, rank, microbatches)) == min(pp - rank, microbatches)


def test_interleaved_rank_0_keeps_megatrons_penalty_in_flight():
    """2 (p - 1) + (v - 1) p + 1 chunks in flight at rank 0: p (1 + (p - 1) / (p v)) microbatches'
    worth of layers."""
    p, v = 4, 2
    most = max(sum(moment) for moment in in_flight(Layout(pp=p, vpp=v), 0, 16))
    assert most == 2 * (p - 1) + (v - 1) * p + 1
    assert most / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


# -- what data parallelism shards


@pytest.mark.parametrize("fsdp, strategy, distributed_optimizer, sharded, every_microbatch, gathers", [
    ("none", "no_shard", False, (), False, 0),
    ("none", "no_shard", True, ("optimizer",), False, 1),
    ("megatron", "no_shard", False, (), False, 0),
    ("megatron", "optim", False, ("optimizer",), True, 1),
    ("megatron", "optim_grads", False, ("optimizer", "grads"), True, 1),
    ("megatron", "optim_grads_params", False, ("optimizer", "grads", "weights"), True, "2m"),
    ("torch", "no_shard", False, ("optimizer", "grads", "weights"), True, "2m"),
])
def test_data_parallel_sharding_divides_what_it_shards_and_moves_it(fsdp, strategy, distributed_optimizer, sharded,
                                                                    every_microbatch, gathers):
    """Sharded states are divided by DP; gradients are all-reduced once a step (DDP), reduce-scattered
    once with the weights all-gathered once (the distributed optimizer), or reduce-scattered every
    microbatch (FSDP), sharded layers all-gathered for every forward and backward (Megatron-FSDP's
    optim and optim_grads: the weights once a step, as measured). Gathered whole beside them, on a
    middle stage (layers only): torch FSDP2 two layers' weights (computing, prefetched) and one's
    gradients, in bf16 as it keeps them; Megatron-FSDP every layer's weights up to its prefetch
    size past the one computing, and one layer's fp32 gradients, or (optim_grads, the chunk one
    unit) the whole stage's gradients."""
    args = gpt3(tp=8, pp=8, dp=16, sp=True, global_batch_size=1536)
    inputs = plan_inputs(args)
    replicated = gpu_costs(inputs, STOCK, 1)  # a middle stage: its layers alone, all alike
    mode = data_parallel_sharding(distributed_optimizer, fsdp, strategy)
    assert mode.reduce_every_microbatch == every_microbatch
    costs = gpu_costs(dataclasses.replace(inputs, sharding=mode), STOCK, 1)
    grad_scale = 0.5 if fsdp == "torch" else 1  # FSDP2's bf16 gradients against DDP's fp32 ones
    for state, scale in (("weights", 1), ("grads", grad_scale), ("optimizer", 1)):
        ratio = getattr(costs, state) / getattr(replicated, state)
        assert ratio == pytest.approx(scale / args.dp if state in sharded else scale, rel=1e-3)
    layers = args.num_layers // args.pp
    layer = replicated.weights / 2 / layers  # one layer's elements on a GPU (bf16 weights)
    expected_gathered = {
        "torch": 2 * layer * 2 + layer * 2,
        "optim_grads": layers * layer * 4,
        "optim_grads_params": min(layers * layer, layer + 500_000_000) * 2 + layer * 4,
    }.get(fsdp if fsdp == "torch" else strategy, 0)
    assert costs.gathered == pytest.approx(expected_gathered, rel=1e-3)
    grads, weights = replicated.grads * grad_scale, replicated.weights  # what is reduced, what is gathered
    share, m = (args.dp - 1) / args.dp, args.num_microbatches
    gathers = {"m": m, "2m": 2 * m}.get(gathers, gathers)
    if every_microbatch:
        expected = share * (m * grads + gathers * weights)
    else:
        expected = share * (grads + weights) if sharded else 2 * share * grads
    assert costs.sent["dp"] == pytest.approx(expected, rel=2e-3)


def test_train_fsdp_flags_reach_the_plan():
    """``--use-torch-fsdp2`` / ``--use-megatron-fsdp --data-parallel-sharding-strategy`` (train's
    flags) shard what the layout says, and the table gains the row of what FSDP gathers whole."""
    ddp = dict(GPT3_70B, tp=1, sp=False, pp=1, dp=64, distributed_optimizer=False, num_layers=8,
               share_embeddings_and_output_weights=False)
    base = every_rank(plan_inputs(PlanArgs(**ddp)), STOCK)[0]
    for flags_, name in ((dict(use_torch_fsdp2=True), "torch FSDP2"),
                         (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"),
                          "Megatron-FSDP optim_grads_params")):
        args = PlanArgs(**ddp, **flags_)
        inputs = plan_inputs(args)
        assert inputs.sharding.name == name
        sharded = every_rank(inputs, STOCK)[0]
        assert sharded.weights == pytest.approx(base.weights / 64) and sharded.gathered > 0
    out = cli_here("plan", *flags(ddp), "--use-torch-fsdp2").stdout
    assert "FSDP: a layer gathered" in out and "data parallelism: torch FSDP2" in out


def _layer(args: PlanArgs, variant: str = STOCK, layer: int = 1):
    inputs = plan_inputs(args)
    tokens = tokens_of(inputs.shape, inputs.layout, args.micro_batch_size)
    return layer_activations(inputs.shape, inputs.layout, tokens, inputs.impl, variant, layer=layer), tokens


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_ropes_cosines_and_sines_follow_rope_fusion_not_the_attention_kernel(impl):
    """Unfused RoPE keeps its cosines and sines for Q and K (4 s d a layer) with flash attention as
    with Megatron's local one; fused RoPE keeps none."""
    args = dict(GPT3_70B, transformer_impl=impl, position_embedding_type="rope")
    (unfused, tokens), (fused, _) = _layer(PlanArgs(**args, rope_fusion=False)), _layer(PlanArgs(**args))
    head_dim = args["hidden_size"] // args["num_attention_heads"]
    assert unfused.total - fused.total == 4 * tokens.seq * head_dim * 2


def test_bf16_unfused_attention_keeps_torchs_fp32_softmax_output_beside_its_copy():
    """Megatron's local attention in bf16 keeps torch's fp32 softmax output and the bf16 copy its
    matmul keeps, 6 bytes a probability; its fused masked softmax (a sequence within its kernel's
    4096) the copy alone; in fp32 they are one tensor."""
    args = dict(GPT3_70B, transformer_impl="local", seq_length=2048)
    (plain, tokens), (fused, _) = _layer(PlanArgs(**args, masked_softmax_fusion=False)), _layer(PlanArgs(**args))
    probabilities = tokens.whole * args["num_attention_heads"] // args["tp"] * args["seq_length"]
    assert plain.total - fused.total == probabilities * 4
    fp32_args = dict(args, dtype="fp32")
    (fp32, _), (fp32_fused, _) = _layer(PlanArgs(**fp32_args, masked_softmax_fusion=False)), _layer(PlanArgs(**fp32_args))
    assert fp32.total == fp32_fused.total
    long = dict(args, seq_length=8192, max_position_embeddings=8192)  # past the kernel's sequence: torch's softmax after all
    assert _layer(PlanArgs(**long, masked_softmax_fusion=False))[0].total == _layer(PlanArgs(**long))[0].total


def test_selective_mlp_recompute_leaves_moe_layers_alone():
    """Megatron's selective "mlp" recomputes dense MLPs only: an MoE layer keeps its router and
    experts under --recompute selective (layernorm and mlp) as without recompute, but its norms'
    outputs; selective "moe" brings them back in backward instead."""
    moe = dict(GPT3_70B, num_moe_experts=8, moe_layer_freq="2", sp=True, add_bias_linear=False)
    plain, _ = _layer(PlanArgs(**moe), layer=0)
    norms, _ = _layer(PlanArgs(**moe, recompute_granularity="selective", recompute_modules=("layernorm",)), layer=0)
    both, _ = _layer(PlanArgs(**moe, recompute="selective"), layer=0)
    experts, _ = _layer(PlanArgs(**moe, recompute_granularity="selective", recompute_modules=("moe",)), layer=0)
    assert both.total == norms.total < plain.total
    assert experts.total < plain.total and experts.recomputed == plain.total - experts.total


# -- the command


def test_plan_prints_both_sides_the_difference_and_whether_they_fit():
    done = cli_here("plan", *flags(GPT3_70B), "--gpu-memory", "h100-80gb")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stock Pre-Norm" in out and "SiameseNorm joined" in out and "SiameseNorm apart" in out
    assert "joined - stock" in out and "apart - stock" in out
    for row in ("weights", "gradients", "optimizer state", "activations kept for backward", "pipeline buffers",
                "TP all-reduce", "SP all-gather", "PP p2p", "DP", "EP all-to-all", "fits h100-80gb",
                "largest micro-batch that fits"):
        assert row in out, row
    assert "layout tp8-pp8-dp16-sp-do: 1024 GPUs" in out
    # what it leaves out it says: context parallelism's exchange inside attention only under CP
    assert "context parallelism's K/V exchange" not in out
    with_cp = cli_here("plan", *flags({**GPT3_70B, "dp": 8}), "--cp", "2").stdout
    assert "not counted in bytes sent: context parallelism's K/V exchange inside attention (--cp 2)" in with_cp


def test_the_paths_shown_follow_the_fused_and_boundary_ops_settings():
    joined = cli_here("plan", *flags(GPT3_70B), "--boundary-ops").stdout
    assert "SiameseNorm joined" in joined and "SiameseNorm apart" not in joined
    pytorch = cli_here("plan", *flags(GPT3_70B), "--no-fused-ops").stdout
    assert "SiameseNorm PyTorch" in pytorch and "SiameseNorm joined" not in pytorch


def test_plan_json_holds_every_stage_and_what_fits(tmp_path):
    path = tmp_path / "plan.json"
    done = cli_here("plan", *flags(GPT3_70B), "--gpu-memory", "40GiB", "--json", path)
    assert done.returncode == 0, done.stderr
    report = json.loads(path.read_text())
    assert report["gpu_bytes"] == 40 * GIB and report["variants"] == ["stock", "joined", "apart"]
    assert all(len(report["stages"][v]) == 8 for v in report["variants"])
    loaded = {v: max(s["memory"] for s in report["stages"][v]) for v in report["variants"]}
    assert report["fits"] == {v: loaded[v] <= 40 * GIB for v in loaded}
    assert loaded["stock"] < loaded["joined"] < loaded["apart"]


def test_every_train_flag_is_taken_and_the_plan_ignores_what_does_not_cost():
    """A train command line pasted whole: Megatron-LM's schedule, checkpoint and logging flags are
    ignored (refused by name where megatron-core has no Megatron-LM parser), a flag nobody has is
    refused."""
    from megatron_siamese.versions import ships_megatron_training

    base = cli_here("plan", *flags(GPT3_70B)).stdout
    megatron_lms = cli_here("plan", *flags(GPT3_70B), "--save", "/nowhere", "--log-interval", "5", "--lr", "3e-4",
                            "--train-iters", "10")
    if ships_megatron_training():
        assert megatron_lms.returncode == 0 and megatron_lms.stdout == base, megatron_lms.stderr
    else:
        assert megatron_lms.returncode == 2
        assert "unrecognized arguments: --save /nowhere --log-interval 5 --lr 3e-4 --train-iters 10" in megatron_lms.stderr
    typo = cli_here("plan", *flags(GPT3_70B), "--save-intervall", "5")
    assert typo.returncode == 2 and "unrecognized arguments: --save-intervall 5" in typo.stderr


def test_the_largest_micro_batch_that_fits_is_the_last_that_does():
    """Among the micro-batches that keep the global batch and feed every stage, the one reported
    fits and the next larger does not; a larger micro-batch keeps more activations."""
    inputs = plan_inputs(PlanArgs(**GPT3_70B))
    gpu = gpu_memory("h200")
    plan = make_plan(inputs, ["joined", "apart"], gpu)
    sizes = micro_batches(inputs)
    assert sizes == [1, 2, 4, 8]  # 64 sequences a DP rank, at least 8 microbatches for 8 stages
    for variant, largest in plan.largest_micro_batch.items():
        memory = [most_loaded(every_rank(with_micro_batch(inputs, size), variant)).memory for size in sizes]
        assert memory == sorted(memory)
        assert memory[sizes.index(largest)] <= gpu and (largest == sizes[-1] or memory[sizes.index(largest) + 1] > gpu)
    assert plan.largest_micro_batch["stock"] >= plan.largest_micro_batch["joined"] >= plan.largest_micro_batch["apart"]
    out = cli_here("plan", *flags(GPT3_70B), "--gpu-memory", "h200").stdout
    line = [line for line in out.splitlines() if "largest micro-batch" in line][0]
    assert line.split()[-3:] == [str(plan.largest_micro_batch[v]) for v in plan.variants]
    # said where the batch, not memory, bounds it
    capped = f"({sizes[-1]}: the largest the global batch allows, memory aside"
    assert (capped in out) == (sizes[-1] in plan.largest_micro_batch.values())
    small = cli_here("plan", *flags({**GPT3_70B, "num_layers": 8}), "--gpu-memory", "h200").stdout
    assert capped in small


REFUSALS = {
    "layers over stages": (["--num-layers", "30", "--pp", "4"], "--num-layers 30 does not split over 4 pipeline stages"),
    "heads over TP": (["--num-attention-heads", "12", "--tp", "8"], "does not split over --tp 8"),
    "batch over DP": (["--global-batch-size", "10"], "must be a multiple of --micro-batch-size x --dp 16"),
    "GPU": (["--gpu-memory", "h300"], "--gpu-memory 'h300': expected a GPU"),
    "stock scheme": (["--norm", "pre"], "use --norm siamese or --norm siamese-layer"),
    "flash without TE": (["--transformer-impl", "local", "--attention-backend", "flash"],
                         "add --transformer-impl transformer_engine"),
    "CP split": (["--cp", "3"], "--seq-length 4096 must be a multiple of 2 x --cp 3 = 6"),
    "CP in TE's unfused attention": (["--cp", "2", "--attention-backend", "unfused"],
                                     "Transformer Engine runs CP in its flash or fused attention"),
    "EP dispatcher": (["--num-experts", "16", "--ep", "4", "--moe-token-dispatcher-type", "allgather",
                       "--disable-bias-linear"], "use --moe-token-dispatcher-type alltoall"),
    "InputNorm ablation": (["--no-siamese-input-norm"], "ablation --no-siamese-input-norm is not modeled"),
    "depth-scale ablation": (["--no-siamese-depth-scale"], "ablation --no-siamese-depth-scale is not modeled"),
    "multi-latent attention": (["--multi-latent-attention", "--sp"], "plan does not model --multi-latent-attention"),
    "multi-token prediction": (["--mtp-num-layers", "1"], "plan does not model --mtp-num-layers"),
    "positions below the sequence": (["--max-position-embeddings", "2048"],
                                     "--max-position-embeddings 2048 is below --seq-length 4096, which Megatron-LM refuses"),
    "a checkpoint's model": (["--use-checkpoint-args"], "--use-checkpoint-args: plan reads no checkpoint"),
    "a Megatron-LM flag not modeled": (["--kv-channels", "64", "--num-layers-per-virtual-pipeline-stage", "5"],
                                       "--kv-channels: heads of another width than --hidden-size over"),
    "two 16-bit dtypes": (["--bf16", "--fp16"], "--fp16 and --bf16: Megatron-LM takes one of them"),
    "JSON nowhere": (["--json", "/nonexistent/plan.json"], "--json /nonexistent/plan.json: no directory"),
    "unmodeled recompute module": (["--recompute-granularity", "selective", "--recompute-modules", "moe_act",
                                    "--num-experts", "16", "--moe-grouped-gemm", "--disable-bias-linear"],
                                   "plan does not model selective recompute of moe_act"),
}


def test_fp16_costs_what_bf16_does_and_sequence_parallelism_at_tp1_is_off_as_in_megatron_lm(tmp_path):
    """Megatron-LM's loss-scaled fp16 keeps a bf16 model's bytes (plan planned fp32 for --fp16, a flag it passed
    on); --sequence-parallel at TP 1 Megatron-LM turns off, and trains (plan refused it)."""
    one_gpu = {**GPT3_70B, "num_layers": 8, "tp": 1, "pp": 1, "dp": 1, "sp": False, "distributed_optimizer": False,
               "global_batch_size": 4}
    del one_gpu["dtype"]
    costs = {}
    for name, extra in (("bf16", ["--bf16"]), ("fp16", ["--dtype", "fp16"]), ("fp16 flag", ["--fp16"]),
                        ("sp", ["--bf16", "--sp"])):
        done = cli_here("plan", *flags(one_gpu), *extra, "--json", str(tmp_path / f"{name}.json"))
        assert done.returncode == 0, done.stderr
        costs[name] = json.loads((tmp_path / f"{name}.json").read_text())["stages"]
    assert costs["fp16"] == costs["bf16"] == costs["fp16 flag"] == costs["sp"]
    assert "--sequence-parallel at TP 1 is off, as Megatron-LM turns it off" in done.stdout


def test_the_flags_refused_as_unmodeled_are_none_of_plans_own():
    """Plan's parser takes its own flags before the rest is looked at: one of them listed as unmodeled would never
    be refused (--recompute-activations, a switch of --recompute-granularity, was)."""
    from megatron_siamese.cli import build_parser
    from megatron_siamese.cli.plan import UNMODELED_FLAGS

    plans = next(action for action in build_parser()._actions if action.dest == "command").choices["plan"]
    assert not set(UNMODELED_FLAGS) & set(plans._option_string_actions)


def test_an_unmodeled_recompute_module_is_one_refusal_not_two_that_disagree():
    """moe_act on a dense model: train's rule says to add grouped-GEMM experts, plan's to leave it out; only
    leaving it out makes a plan."""
    done = cli_here("plan", *flags(GPT3_70B), "--recompute-granularity", "selective", "--recompute-modules", "moe_act")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "megatron-siamese plan: error: plan does not model selective recompute of moe_act (it models layernorm, mlp, "
        "moe, shared_experts, core_attn): leave it out of --recompute-modules"], done.stderr


def test_a_tokenizer_is_refused_without_the_size_of_its_vocabulary():
    """Megatron-LM reads the vocabulary off the tokenizer, which plan does not load: it planned the byte one."""
    model = {key: value for key, value in GPT3_70B.items() if key != "vocab_size"}
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "vocab.json"]
    done = cli_here("plan", *flags(model), *tokenizer)
    assert done.returncode == 2 and "--tokenizer-type GPT2BPETokenizer, --vocab-file: plan reads no tokenizer, so " \
        "give its vocabulary's size as --vocab-size" in done.stderr, done.stderr
    # a tokenizer's files without its type (which train refuses too): planned with the byte vocabulary before
    files = cli_here("plan", *flags(model), "--vocab-file", "vocab.json", "--merge-file", "merges.txt")
    assert files.returncode == 2 and "error: --vocab-file, --merge-file: plan reads no tokenizer" in files.stderr, \
        files.stderr


def test_query_groups_without_megatron_lms_switch_are_refused_as_train_would_ignore_them():
    """Megatron-LM builds every head its own keys and values unless --group-query-attention is given; the
    plan counted the groups all the same."""
    done = cli_here("plan", *flags({**GPT3_70B, "group_query_attention": False}))
    assert done.returncode == 2 and "--num-query-groups 8 without --group-query-attention: Megatron-LM ignores it" \
        in done.stderr, done.stderr


def test_a_problem_is_said_once():
    """The CP sequence rule is the split's (``divisibility.context_problems``); plan said it again in its words."""
    done = cli_here("plan", *flags(GPT3_70B), "--cp", "3")
    assert done.returncode == 2 and done.stderr.count("must be a multiple of 2 x") == 1, done.stderr


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_settings_the_plan_cannot_honour_are_refused_by_name(name):
    extra, message = REFUSALS[name]
    done = cli_here("plan", *flags(GPT3_70B), *extra)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stdout == ""


def test_plan_is_arithmetic_no_torch_no_megatron_no_ranks():
    """The command in a process of its own: it prints its plan having imported neither torch nor
    Megatron (so it starts no rank)."""
    script = ("import contextlib, io, sys\nfrom megatron_siamese.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(sys.argv[1:]) == 0\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    done = subprocess.run([sys.executable, "-c", script, "plan", *flags(GPT3_70B)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_gpu_memory_by_name_and_size():
    assert gpu_memory("h100") == gpu_memory("h100-80gb") == 81559 * 2**20
    assert gpu_memory("80GiB") == 80 * GIB and gpu_memory("141GB") == 141 * 10**9
    with pytest.raises(ValueError):
        gpu_memory("80")
    with pytest.raises(ValueError, match="more than nothing"):
        gpu_memory("0GiB")
    with pytest.raises(ConfigError):
        PlanArgs(**{**GPT3, "tp": 8, "gpu_memory": "lots"})


# a 70B-class model on 1024 GPUs (docs/scale.md's second configuration)
GPT3_70B = dict(num_layers=80, hidden_size=8192, num_attention_heads=64, group_query_attention=True,
                num_query_groups=8, max_position_embeddings=4096, ffn_hidden_size=28672,
                gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                hidden_dropout=0.0, attention_dropout=0.0, seq_length=4096, vocab_size=128256, dtype="bf16",
                transformer_impl="transformer_engine", tp=8, sp=True, pp=8, dp=16, distributed_optimizer=True,
                micro_batch_size=1, global_batch_size=1024)


def flags(settings: dict) -> list:
    """Command-line flags for ``settings`` (PlanArgs fields), as a user writes them: each setting's first
    flag, a switch by whichever of its flags sets the value (none where only the default does)."""
    found = []
    for name, value in settings.items():
        definition = SETTINGS[name]
        flag = definition.flags[0]
        if not isinstance(value, bool):
            found += [flag, str(value)]
        elif definition.action is argparse.BooleanOptionalAction:
            found.append(flag if value else "--no-" + flag[2:])
        else:
            setters = [(flag, definition.action != "store_false"),
                       *((switch.flags[0], switch.action != "store_false") for switch in definition.switches)]
            found += [setter for setter, sets in setters if sets == value][:1]
    return found
