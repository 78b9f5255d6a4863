"""Each setting is defined once (runtime/registry.py): the parser, the validation and the
TransformerConfig keywords are derived from that definition, and a second definition of a
flag is refused."""

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

import pytest

from megatron_siamese.check.case import ModelCase
from megatron_siamese.cli import check, flags
from megatron_siamese.hybrid_pattern import HybridPattern
from megatron_siamese.runtime.layout import Layout, parse_layout
from megatron_siamese.runtime.registry import KEY, DuplicateSetting, definitions, field_problems, setting
from megatron_siamese.runtime.settings import MLA_SETTINGS, ModelSettings, model_class_problems
from megatron_siamese.training.args import ConfigError, TrainArgs

stack_independent = pytest.mark.stack_independent  # plain data: the same on every megatron-core


def train_parser():
    """A parser of every TrainArgs setting, group by group, as the commands that take them build theirs."""
    from megatron_siamese.cli import Parser, flags

    parser = Parser(prog="settings")
    for title in dict.fromkeys(definition.group for definition in flags.SETTINGS.values()):
        flags.add_group(parser, title)
    return parser


@stack_independent
def test_every_train_args_field_is_one_setting_whose_flags_the_parser_has():
    by_dest = {}
    for action in train_parser()._actions:
        by_dest.setdefault(action.dest, set()).update(action.option_strings)
    for field in dataclasses.fields(TrainArgs):
        definition = field.metadata.get(KEY)
        assert definition is not None and definition.flags, f"TrainArgs.{field.name} has no setting() with flags"
        assert by_dest.pop(field.name) == set(definitions(TrainArgs)[field.name].all_flags), field.name
    assert set(by_dest) == {"help"}  # no stray setting


@stack_independent
def test_the_parser_defaults_are_the_dataclass_defaults():
    options = train_parser().parse_args([])
    for field in dataclasses.fields(TrainArgs):
        assert getattr(options, field.name) == field.default, field.name
    assert flags.train_args(options) == TrainArgs()


@stack_independent
def test_aliases_and_switches_set_their_one_field():
    parse = train_parser().parse_args
    assert parse(["--tp", "4"]).tp == parse(["--tensor-model-parallel-size", "4"]).tp == 4
    assert parse(["--bf16"]).dtype == parse(["--dtype", "bf16"]).dtype == "bf16"
    assert parse(["--disable-bias-linear"]).add_bias_linear is False
    assert parse(["--add-bias-linear"]).add_bias_linear is True
    assert parse(["--no-swiglu"]).gated_linear_unit is False
    assert parse(["--untie-embeddings-and-output-weights"]).share_embeddings_and_output_weights is False


@stack_independent
def test_a_flag_defined_twice_is_refused():
    @dataclass(frozen=True)
    class Planted(TrainArgs):
        tensor_parallel: int = setting(1, group="parallelism", flag="--tp", help="a second tensor-parallel size")

    with pytest.raises(DuplicateSetting, match=r"Planted.tensor_parallel claims --tp, which Planted.tp"):
        definitions(Planted)


@stack_independent
def test_a_config_or_layout_field_set_by_two_settings_is_refused():
    @dataclass(frozen=True)
    class TwoWidths(ModelSettings):
        width: int = setting(64, flag="--width", help="width", config="hidden_size")

    @dataclass(frozen=True)
    class TwoTp(TrainArgs):
        tensor_parallel: int = setting(1, flag="--tensor-parallel", help="tp", layout="tp")

    with pytest.raises(DuplicateSetting, match="TransformerConfig.hidden_size"):
        definitions(TwoWidths)
    with pytest.raises(DuplicateSetting, match="Layout.tp"):
        definitions(TwoTp)


@stack_independent
def test_values_are_checked_against_their_definitions():
    @dataclass(frozen=True)
    class Knobs:
        size: int = setting(1, flag="--size", help="a size", minimum=1)
        kind: str = setting("a", flag="--kind", help="a kind", choices=("a", "b"))
        maybe: Optional[str] = setting(None, flag="--maybe", help="optional", choices=("x",))
        even: int = setting(2, flag="--even", help="even", check=lambda v: None if v % 2 == 0 else "--even: odd")

    assert field_problems(Knobs()) == {}
    assert field_problems(Knobs(size=0, kind="c", maybe="y", even=3)) == {
        "size": "--size must be at least 1 (got 0)", "kind": "--kind must be one of a, b (got 'c')",
        "maybe": "--maybe must be one of x (got 'y')", "even": "--even: odd"}


@stack_independent
def test_world_size_and_layout_come_from_the_layout_settings():
    args = TrainArgs(tp=2, pp=2, vpp=2, dp=2, sp=True, distributed_optimizer=True, recompute="full")
    assert args.layout == Layout(tp=2, pp=2, vpp=2, cp=1, dp=2, sp=True, distributed_optimizer=True,
                                 recompute="full")
    assert args.world_size == args.layout.world_size == 8


@stack_independent
@pytest.mark.parametrize("flags_, name, config", [
    ([], "tp2", {}),
    (["--recompute", "full"], "tp2-full",
     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], "tp2-full2",
     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"], "tp2-fullblock3",
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3)),
    # Megatron-LM's default modules: the core attention alone (not this package's preset)
    (["--recompute-granularity", "selective"], "tp2-sel=core_attn",
     dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    (["--recompute-activations"], "tp2-sel=core_attn",
     dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"], "tp2-sel",
     dict(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])),
    (["--recompute", "selective"], "tp2-sel", dict(recompute_granularity="selective",
                                                   recompute_modules=["layernorm", "mlp"])),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"], "tp2-sel=core_attn.mlp",
     dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])),
])
def test_megatron_lms_recompute_flags_mean_what_they_mean_there(flags_, name, config):
    """Megatron-LM's --recompute-granularity / -method / -num-layers / -modules (and
    --recompute-activations) make the TransformerConfig fields Megatron-LM makes of them, and a
    layout whose name reads back to the same layout."""
    args = flags.train_args(train_parser().parse_args(flags_))
    assert args.layout.name == name and parse_layout(name) == args.layout
    assert args.layout.recompute_options() == config


@stack_independent
@pytest.mark.parametrize("changes, refusal", [
    (dict(recompute="full", recompute_granularity="selective"), "--recompute full and --recompute-granularity selective"),
    (dict(recompute_granularity="full"), "full recompute needs --recompute-method uniform"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "full recompute needs --recompute-num-layers"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
     "recomputes each model chunk's 4 layers in groups of --recompute-num-layers 3"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "--recompute-num-layers applies to full"),
    (dict(recompute_modules=("mlp",)), "--recompute-modules needs selective recompute"),
    (dict(recompute_granularity="selective", recompute_modules=("attention",)),
     "--recompute-modules attention: not a module Megatron recomputes"),
    (dict(recompute_granularity="selective", recompute_modules=("moe",)), "recomputes MoE layers: add --num-experts"),
    (dict(recompute_granularity="selective", recompute_modules=("moe_act",), num_moe_experts=4, sp=True),
     "grouped-GEMM experts"),
    (dict(recompute_granularity="selective", recompute_modules=("mla_up_proj",)), "multi-latent attention"),
])
def test_recompute_flags_megatron_refuses_or_that_do_nothing_are_refused_by_name(changes, refusal):
    with pytest.raises(ConfigError) as refused:
        TrainArgs(**changes)
    assert any(refusal in problem for problem in refused.value.problems), refused.value.problems


@stack_independent
@pytest.mark.parametrize("name, fsdp, sharding, distributed_optimizer", [
    ("dp2-fsdp2", "torch", "no_shard", False),
    ("tp2-dp2-sp-fsdp2-full", "torch", "no_shard", False),
    ("dp2-mfsdp3", "megatron", "optim_grads_params", True),  # Megatron-FSDP always on the distributed optimizer
    ("tp2-dp4-sp-mfsdp3", "megatron", "optim_grads_params", True),
    ("dp4-ep2-mfsdp2", "megatron", "optim_grads", True),
])
def test_fsdp_layout_names_read_back_and_the_train_flags_make_the_same_layout(name, fsdp, sharding,
                                                                               distributed_optimizer):
    layout = parse_layout(name)
    assert (layout.fsdp, layout.fsdp_sharding, layout.distributed_optimizer) == (fsdp, sharding, distributed_optimizer)
    assert layout.name == name and parse_layout(layout.name) == layout
    parse = train_parser().parse_args
    flag = {"torch": ["--use-torch-fsdp2"], "megatron": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                                         sharding]}[fsdp]
    sizes = ["--tp", str(layout.tp), "--dp", str(layout.dp), "--ep", str(layout.ep)] + ["--sp"] * layout.sp
    options = parse(sizes + flag + ["--recompute", layout.recompute.preset, "--disable-bias-linear", "--micro-batch-size", "1"]
                    + ["--num-experts", "4"] * (layout.ep > 1))
    assert flags.train_args(options).layout == layout
    if fsdp == "megatron":  # "do" is implied: one layout, one name
        assert parse_layout(name + "-do") == layout


@stack_independent
@pytest.mark.parametrize("layout, named, train, refusal", [
    ("dp2-do-fsdp2", "torch FSDP2 (fsdp2) does not run with Megatron's distributed optimizer (do)",
     dict(use_torch_fsdp2=True, distributed_optimizer=True),
     "--use-torch-fsdp2 does not run with --use-distributed-optimizer (Megatron-LM refuses it"),
    ("pp2-dp2-fsdp2", "torch FSDP2 (fsdp2) does not run with pipeline parallelism (Megatron-LM refuses it): use pp1",
     dict(use_torch_fsdp2=True, pp=2), "--use-torch-fsdp2 does not run with pipeline parallelism (Megatron-LM "
                                       "refuses it): use --pp 1"),
    ("pp2-dp2-mfsdp3", "as if every rank were dp x ep x tp (mcore_fsdp_adapter.py",
     dict(use_megatron_fsdp=True, pp=2), "as if every rank were dp x ep x tp (mcore_fsdp_adapter.py"),
    ("fsdp2", "torch FSDP2 (fsdp2) shards over the data-parallel ranks: it needs more than one (dp2 or more)",
     dict(use_torch_fsdp2=True, dp=1),
     "--use-torch-fsdp2 shards over the data-parallel ranks: it needs more than one (--dp 2 or more)"),
    ("dp2-ep2-fsdp2", "torch FSDP2 (fsdp2) does not run with expert parallelism (Megatron-LM refuses it): use ep1",
     dict(use_torch_fsdp2=True, ep=2, num_moe_experts=2, sp=True, tp=1),
     "--use-torch-fsdp2 does not run with expert parallelism (Megatron-LM refuses it): use --ep 1"),
    (None, None, dict(data_parallel_sharding_strategy="optim"), "is Megatron-FSDP's: add --use-megatron-fsdp"),
    (None, None, dict(use_torch_fsdp2=True, use_megatron_fsdp=True), "two implementations of one thing: pass one"),
])
def test_fsdp_combinations_megatron_refuses_are_refused_by_layout_and_train(layout, named, train, refusal):
    if layout is not None:
        with pytest.raises(ValueError, match=re.escape(named)):
            parse_layout(layout)
    with pytest.raises(ConfigError) as refused:
        TrainArgs(**{"tp": 1, "dp": 2, **train})
    assert any(refusal in problem for problem in refused.value.problems), refused.value.problems


@stack_independent
def test_megatron_fsdp_refuses_experts_held_by_one_rank_in_both_spellings():
    with pytest.raises(ValueError, match=re.escape("Megatron-FSDP (mfsdpN) does not run with experts held by one rank "
                                                   "of each expert-data-parallel group")):
        parse_layout("dp2-ep2-mfsdp2")
    with pytest.raises(ConfigError) as refused:
        TrainArgs(tp=1, dp=2, ep=2, num_moe_experts=2, use_megatron_fsdp=True,
                  data_parallel_sharding_strategy="optim_grads")
    assert any("--use-megatron-fsdp does not run with experts held by one rank" in problem and "use --dp 4" in problem
               for problem in refused.value.problems), refused.value.problems


@stack_independent
def test_train_and_check_refuse_a_split_with_the_same_rule():
    with pytest.raises(ConfigError) as refused:
        TrainArgs(num_attention_heads=6, hidden_size=96, tp=4)
    found = check.problems(ModelCase(num_attention_heads=6, hidden_size=96, num_query_groups=None), ["tp4"])
    assert "--num-attention-heads 6 does not split over --tp 4" in refused.value.problems[0]
    assert "layout tp4: --num-attention-heads 6 does not split over tp4" in found[0]
    # a hybrid pattern's '|' segments must be one per pipeline stage, in both commands
    case = ModelCase(model="hybrid", hybrid_layer_pattern="*-|*-|*-")
    on_this_megatron = model_class_problems(case)  # megatron-core < 0.19 also refuses --model hybrid itself
    assert check.problems(case, ["pp2"]) == on_this_megatron + [
        "layout pp2: --hybrid-layer-pattern has 3 pipeline segments ('|') for 2 pipeline stages (pp2): "
        "write one segment per stage"]
    assert check.problems(case, [parse_layout("pp3").name]) == on_this_megatron


@stack_independent
def test_train_and_check_refuse_a_context_parallel_split_with_the_same_rule():
    with pytest.raises(ConfigError) as refused:
        TrainArgs(seq_length=102, cp=2)
    assert refused.value.problems == ["--seq-length 102 must be a multiple of 2 x --cp 2 = 4 (context parallelism "
                                      "cuts each sequence into 2 x cp chunks, two per rank)"]
    assert check.problems(ModelCase(seq_length=20), ["cp4"]) == [
        "layout cp4: --seq-length 20 must be a multiple of 2 x cp4 = 8 (context parallelism cuts each sequence into "
        "2 x cp chunks, two per rank)"]
    with pytest.raises(ConfigError) as refused:
        TrainArgs(seq_length=36, cp=2, tp=4, sp=True, num_query_groups=4)
    assert refused.value.problems == [
        "each CP rank's 18 tokens (--seq-length 36 / --cp 2) must split over --tp 4 under sequence parallelism: "
        "use a sequence length that is a multiple of 16"]
    with pytest.raises(ConfigError, match="--mtp-num-layers under context parallelism"):
        TrainArgs(cp=2, mtp_num_layers=1)
    TrainArgs(seq_length=128, cp=4, tp=2, sp=True)  # 32 tokens a CP rank, 16 a TP rank


@stack_independent
def test_hybrid_patterns_are_read_in_one_place():
    pattern = HybridPattern("*-M*|*-M*/*-")
    assert (pattern.main, pattern.mtp, pattern.layers) == ("*-M*|*-M*", "*-", "*-M**-M*")
    assert pattern.segments == ["*-M*", "*-M*"] and pattern.has_boundaries
    assert HybridPattern("*-*-/-").staged(2) == "*-|*-/-"
    with pytest.raises(ValueError, match="do not split evenly into 3"):
        HybridPattern("*-*-").staged(3)


# Not stack-independent: TransformerConfig's fields are megatron-core's, per release.
def test_every_setting_naming_a_transformer_config_field_reaches_it(monkeypatch):
    from megatron_siamese.model_names import SCHEME_NAMES
    from megatron_siamese.models import SCHEMES
    from megatron_siamese.runtime.gpt import transformer_config

    assert tuple(SCHEMES) == SCHEME_NAMES
    changed = dict(hidden_size=64, num_attention_heads=8, num_query_groups=4, normalization="LayerNorm",
                   gated_linear_unit=False, add_bias_linear=True, zero_centered_gamma=True, init_method_std=0.01,
                   fused_ops=False, boundary_ops=False, transformer_impl="transformer_engine", fp8="e4m3",
                   fp8_recipe="tensorwise",
                   tp=4, pp=2, vpp=2, cp=2, num_layers=4, sp=True,
                   num_moe_experts=8, moe_router_topk=3, moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=32,
                   moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.001, moe_router_load_balancing_type="seq_aux_loss", moe_router_pre_softmax=True, qk_layernorm=True,
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=True)
    args = TrainArgs(**changed)
    # TransformerConfig asks Transformer Engine's version for FP8 with MoE; it is not installed here
    monkeypatch.setattr("megatron.core.transformer.transformer_config.is_te_min_version", lambda *_: True)
    layout = dataclasses.replace(args.layout, ep=2, etp=1)
    # the schemes' own settings, which TrainArgs refuses beside another scheme's (next test), all at once
    # ... and multi-latent attention's and multi-token prediction's (MLA has no query groups: TrainArgs
    # refuses them together), MLA's reaching MLATransformerConfig's fields of their names
    own = dict(siamese_input_norm=False, siamese_depth_scale=False, mix_ln_alpha=0.5, hybridnorm_star=True,
               multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8,
               v_head_dim=16, rope_type="rope", rotary_scaling_factor=2.0, mtp_num_layers=2,
               mtp_loss_scaling_factor=0.3)
    args = ModelSettings(**{name: getattr(args, name) for name in definitions(ModelSettings) if name not in own}, **own)
    config = transformer_config(args, layout)
    declared = [(args, name, d) for name, d in definitions(ModelSettings).items() if d.config]
    declared += [(layout, name, d) for name, d in definitions(Layout).items() if d.config]
    assert len(declared) >= 15
    for values, name, definition in declared:
        value = getattr(values, name)
        assert value != definition.default, f"{name}: give it a value other than its default here"
        assert getattr(config, definition.config) == value, f"{name} does not reach {definition.config}"
    for name in MLA_SETTINGS:
        assert getattr(args, name) != definitions(ModelSettings)[name].default, f"{name}: give it another value"
        assert getattr(config, name) == getattr(args, name), f"{name} does not reach MLATransformerConfig"


@stack_independent
def test_a_schemes_own_settings_are_refused_beside_another_scheme():
    """--mix-ln-alpha, --hybridnorm-star and the SiameseNorm ablations change nothing for the other
    schemes: train and check refuse them there, and --mix-ln-alpha is a share of the layers."""
    assert TrainArgs(norm="mixln", mix_ln_alpha=0.5).mix_ln_alpha == 0.5
    assert not TrainArgs(norm="siamese-hybrid", siamese_input_norm=False, siamese_depth_scale=False).siamese_input_norm
    with pytest.raises(ConfigError) as refused:
        TrainArgs(norm="pre", mix_ln_alpha=0.5, hybridnorm_star=True, siamese_depth_scale=False)
    assert refused.value.problems == [
        "--no-siamese-depth-scale applies to --norm siamese / siamese-layer / siamese-hybrid, not --norm pre: drop it",
        "--mix-ln-alpha applies to --norm mixln, not --norm pre: drop it",
        "--hybridnorm-star applies to --norm hybridnorm, not --norm pre: drop it"]
    # the check names its own flag and its names for the schemes (stock: Pre-Norm)
    assert check.problems(ModelCase(norm="post", siamese_input_norm=False), ["tp2"]) == [
        "--no-siamese-input-norm applies to --spec siamese / siamese-layer / siamese-hybrid, not --spec post: drop it"]
    assert check.problems(ModelCase(norm="pre", hybridnorm_star=True), ["tp2"]) == [
        "--hybridnorm-star applies to --spec hybridnorm, not --spec stock: drop it"]
    with pytest.raises(ConfigError, match="--mix-ln-alpha is a share of the layers, at most 1"):
        TrainArgs(norm="mixln", mix_ln_alpha=1.5)
