"""Mixture-of-experts settings: the rules that refuse an expert layout the ranks cannot regroup, what
a resume may change about the experts, and the MoE examples, whose
command lines Megatron-LM's parser reads (MoE training in Megatron-LM's loop: test_pretrain.py)."""

import os
import subprocess
from pathlib import Path

import pytest

from megatron_siamese.training.args import ConfigError, TrainArgs
from megatron_siamese.training.checkpoint_settings import (
    SETTINGS_KEY,
    model_problem,
    recorded,
)
from megatron_siamese.versions import ships_megatron_training


@pytest.mark.stack_independent
def test_expert_parallelism_must_fit_the_ranks_it_regroups():
    with pytest.raises(ConfigError) as refused:
        TrainArgs(tp=1, dp=3, ep=2, num_moe_experts=4, global_batch_size=24)
    assert refused.value.problems == [
        "--expert-model-parallel-size/--ep 2 x --expert-tensor-parallel-size/--etp 1 = 2 must divide --tp 1 x --dp 3 "
        "= 3 (expert parallelism adds no ranks: it regroups those of a pipeline stage): use --dp 4 (a multiple of 2)"]
    args = TrainArgs(tp=2, dp=1, ep=2, etp=1, sp=True, num_moe_experts=4)
    assert args.world_size == 2 and args.layout.name == "tp2-ep2-etp1-sp"
    with pytest.raises(ConfigError, match=r"--etp 2 = 4 must divide --tp 2 x --dp 1 = 2 .*use --dp 2"):
        TrainArgs(tp=2, ep=2, sp=True, num_moe_experts=4)
    # context-parallel ranks are regrouped too (the check's cp2-ep2): taken, and counted when they fall short
    assert TrainArgs(tp=1, cp=2, ep=2, num_moe_experts=4).layout.name == "cp2-ep2"
    with pytest.raises(ConfigError, match=r"--ep 4 x .*--etp 1 = 4 must divide --tp 1 x --cp 2 x --dp 1 = 2 .*use --dp 2"):
        TrainArgs(tp=1, cp=2, ep=4, num_moe_experts=4)


@pytest.mark.stack_independent
def test_a_resume_keeps_the_experts_and_may_change_how_they_are_split_and_fed():
    saved = recorded(TrainArgs(tp=1, dp=2, ep=2, num_moe_experts=4, moe_layer_freq="[1,0,1,0]"))
    same = [dict(tp=2, ep=1, sp=True), dict(tp=1, dp=2, ep=2, moe_layer_freq="([1,0])*2"), dict(moe_layer_freq="2"),
            dict(moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-3,
                 moe_router_load_balancing_type="seq_aux_loss", moe_ffn_hidden_size=512)]
    for changes in same:
        assert model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(**{"num_moe_experts": 4, "tp": 1,
                                                                           "moe_layer_freq": "[1,0,1,0]",
                                                                           **changes})) is None, changes
    refused = model_problem("ckpt", {SETTINGS_KEY: saved},
                            TrainArgs(tp=1, num_moe_experts=8, moe_router_topk=3, moe_layer_freq="1"))
    assert ("--num-experts 4 -> 8, --moe-router-topk 2 -> 3, --moe-layer-freq [1, 0, 1, 0] -> [1, 1, 1, 1]"
            in refused), refused
    assert "--num-experts 4 -> unset" in model_problem("ckpt", {SETTINGS_KEY: saved}, TrainArgs(tp=1))


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def handed_over(script, tmp_path, **env):
    """The command line an example hands to srun, torchrun or $PYTHON (stand-ins record it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "record"
    for tool in ("srun", "torchrun", "recorder"):
        (bin_dir / tool).write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$RECORD"\n')
        (bin_dir / tool).chmod(0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node001\necho node002\n")
    (bin_dir / "scontrol").chmod(0o755)
    variables = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record), PYTHON="recorder",
                     SLURM_JOB_NODELIST="node[001-002]", SLURM_NNODES="2", SLURM_JOB_ID="77", **env)
    subprocess.run(["bash", str(EXAMPLES / script)], check=True, env=variables, cwd=tmp_path)
    handed = record.read_text().split("\0")[:-1]
    return handed[handed.index("megatron_siamese.cli") + 1:]


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: no Megatron-LM parser to read them")
def test_the_moe_examples_hand_over_runs_that_parse(tmp_path):
    from cli_runs import megatron_lm_args

    slurm, _ = megatron_lm_args(handed_over("slurm/pretrain_moe.sbatch", tmp_path, OUT=str(tmp_path / "out")))
    assert (slurm.tensor_model_parallel_size, slurm.expert_model_parallel_size,
            slurm.expert_tensor_parallel_size, slurm.num_experts) == (2, 8, 1, 16)
    assert slurm.moe_token_dispatcher_type == "alltoall" and slurm.save == slurm.load
    gpus, _ = megatron_lm_args(handed_over("pretrain_moe_siamese.sh", tmp_path, OUT=str(tmp_path / "out")))
    assert (gpus.expert_model_parallel_size, gpus.moe_grouped_gemm, gpus.transformer_impl) == (
        4, True, "transformer_engine")
    cpu, ranks = megatron_lm_args(handed_over("pretrain_moe_siamese.sh", tmp_path, OUT=str(tmp_path / "out"), CPU="1"))
    assert (ranks, cpu.expert_model_parallel_size, cpu.moe_token_dispatcher_type) == (2, 2, "allgather")


