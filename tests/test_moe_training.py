"""Training a mixture-of-experts SiameseNorm GPT as a user does (the CLI: in a subprocess where its
own output is the point, else its main() in this process, tests/cli_runs.py): the MoE and
expert-parallel flags, the router statistics in every log, and checkpoints that resume
under another EP/TP/PP layout with the losses of the uninterrupted run; a DeepSeek-shaped model
(multi-latent attention, a shared expert, multi-token prediction) likewise."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_refusals import assert_one_line_refusal
from cli_runs import cli_here, our_loop_only

from megatron_siamese.training.args import ConfigError, TrainArgs
from megatron_siamese.training.checkpoint_settings import (
    SETTINGS_KEY,
    model_problem,
    optimizer_split_problem,
    recorded,
)
from megatron_siamese.versions import ships_megatron_training

CLI = [sys.executable, "-m", "megatron_siamese.cli"]
# two layers, the first MoE and the second dense: PP2 puts a stage without experts in the job
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[1,0]", "--moe-z-loss-coeff", "1e-3",
       # the alltoall dispatcher needs more of the CUDA redirection on CPU than allgather
       "--moe-token-dispatcher-type", "allgather"]
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "2", "--no-progress",
         "--log-interval", "1", *MOE]
ROUTER = ("load_balancing_loss", "z_loss", "busiest_expert_load")
MTP = ("mtp_1 loss",)
# DeepSeek-V3's shape, small: multi-latent attention (queries through their own latent, latent
# norms), a dense first layer and an MoE second with a shared expert, one multi-token prediction
# layer (an MoE layer, as the decoder's last)
DEEPSEEK = ["--moe-layer-freq", "[0,1]", "--moe-shared-expert-intermediate-size", "64", "--multi-latent-attention",
            "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
            "--v-head-dim", "8", "--qk-layernorm", "--mtp-num-layers", "1", "--disable-bias-linear"]


def train(output, cache, *args, timeout=600):
    """The command in its own process (the bar on its stderr is rank 0's own output)."""
    our_loop_only(["train"])
    start = time.monotonic()
    done = subprocess.run([*CLI, "train", *SMALL, "--cache-dir", cache, "--output-dir", output, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
    done.seconds = time.monotonic() - start
    return done


def train_here(output, cache, *args):
    """The command's main() in this process: its losses and router statistics (lines through the
    launcher), with ranks from this session's fork server."""
    return cli_here("train", *SMALL, "--cache-dir", cache, "--output-dir", output, *args)


def logged(done) -> dict:
    """Step -> {"loss": lm loss, router statistic: value}, from Megatron-LM's iteration lines."""
    found = {}
    for line in done.stdout.splitlines():
        step = re.search(r"iteration\s+(\d+)/", line)
        if step:
            values = dict(re.findall(r"\| (lm loss|mtp_\d+ loss|\w+): ([0-9.E+-]+) (?=\|)", line))
            found[int(step.group(1))] = {"loss": float(values["lm loss"]),
                                         **{name: float(values[name]) for name in (*ROUTER, *MTP) if name in values}}
    return found


def assert_same_steps(resumed: dict, straight: dict, steps, router=ROUTER):
    for step in steps:
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], abs=2e-4), step
        for name in router:
            assert resumed[step][name] == pytest.approx(straight[step][name], rel=1e-4, abs=1e-4), (step, name)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def ep2(tmp_path_factory, cache):
    """4 steps at DP2 x EP2 (each rank holds two of the four experts), checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("ep2") / "run"
    done = train(root, cache, "--tp", "1", "--dp", "2", "--ep", "2", "--steps", "4", "--save-interval", "2",
                 "--tensorboard-dir", root / "tb", "--progress")  # the bar (on stderr) and the lines
    assert done.returncode == 0, done.stderr
    done.root, done.steps = root, logged(done)
    return done


# -- settings, no rank started ----------------------------------------------------------

@pytest.mark.stack_independent
def test_expert_parallelism_must_fit_the_ranks_it_regroups():
    with pytest.raises(ConfigError) as refused:
        TrainArgs(tp=1, dp=3, ep=2, num_moe_experts=4, global_batch_size=24)
    assert refused.value.problems == [
        "--expert-model-parallel-size/--ep 2 x --expert-tensor-parallel-size/--etp 1 = 2 must divide --tp 1 x --dp 3 "
        "= 3 (expert parallelism adds no ranks: it regroups those of a pipeline stage): use --dp 4 (a multiple of 2)"]
    args = TrainArgs(tp=2, dp=1, ep=2, etp=1, sp=True, num_moe_experts=4)
    assert args.world_size == 2 and args.layout.name == "tp2-ep2-etp1-sp"
    our_loop_only(["train"])
    done = subprocess.run([*CLI, "train", "--num-experts", "4", "--ep", "2", "--sp"], capture_output=True, text=True)
    assert_one_line_refusal(done, "--etp 2 = 4 must divide --tp 2 x --dp 1 = 2", "use --dp 2")


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


@pytest.mark.stack_independent
def test_an_optimizer_state_split_otherwise_is_refused_naming_what_loads_it():
    common = {SETTINGS_KEY: {"ep": 2}, "optimizer": {0: {"state": {}}, 1: {"state": {}}}}
    assert optimizer_split_problem("ckpt", common, 2, TrainArgs(tp=2, ep=1)) is None  # the same split
    assert optimizer_split_problem("ckpt", common, 1, TrainArgs(tp=2, no_load_optim=True)) is None
    assert "resume with expert parallelism (--ep 2 or more)" in optimizer_split_problem("ckpt", common, 1, TrainArgs())
    one = {SETTINGS_KEY: {"ep": 1}, "optimizer": {"state": {}, "param_groups": []}}
    assert "holds one optimizer's state for all parameters (saved at --ep 1)" in optimizer_split_problem(
        "ckpt", one, 2, TrainArgs(tp=1, dp=2, ep=2, num_moe_experts=4))


# -- training ----------------------------------------------------------------------------

def test_an_expert_parallel_run_learns_and_reports_its_routers_everywhere(ep2):
    assert "Traceback" not in ep2.stdout + ep2.stderr
    steps = ep2.steps
    assert sorted(steps) == [1, 2, 3, 4] and all(set(ROUTER) <= set(values) for values in steps.values())
    assert steps[4]["loss"] < steps[1]["loss"] - 0.05
    for values in steps.values():
        assert 0.5 < values["load_balancing_loss"] < 2.0  # Megatron's switch loss: 1.0 when balanced
        assert 1.0 <= values["busiest_expert_load"] <= 2.0  # at most experts / top-k
        assert values["z_loss"] > 0.0
    written = [entry for entry in map(json.loads, (ep2.root / "metrics.jsonl").read_text().splitlines())
               if "loss" in entry]
    for entry in written:  # the file holds what the lines show
        for name in ROUTER:
            assert entry[name] == pytest.approx(steps[entry["step"]][name], rel=1e-5, abs=6e-3)
    summary = json.loads((ep2.root / "summary.json").read_text())
    assert sorted(summary["router_stats"], key=int) == ["1", "2", "3", "4"]
    assert summary["router_stats"]["4"]["load_balancing_loss"] == pytest.approx(steps[4]["load_balancing_loss"],
                                                                                rel=1e-5)
    for shown in (r"aux=\d\.\d{3}", r"max_load=\d\.\d\dx", r"z=\d\.\d{3}"):  # on the bar, with its loss
        assert re.search(rf"\|.*{shown}", ep2.stderr), ep2.stderr[-2000:]
    assert "layout=tp1 pp1 dp2 ep2" in ep2.stdout
    assert re.search(r"router at step 4: load_balancing_loss [0-9.]+, z_loss [0-9.]+; busiest expert [0-9.]+x the "
                     r"mean load \(highest [0-9.]+x at step \d\)", ep2.stdout), ep2.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(ep2.root / "tb"))
    events.Reload()
    for name in ROUTER:  # Megatron-LM's names for its tracked losses
        assert [event.step for event in events.Scalars(name)] == [1, 2, 3, 4]


def test_a_checkpoint_continues_under_another_tp_and_expert_layout(tmp_path, cache, ep2):
    """DP2 x EP2 -> TP2 with SP and EP2 over the same two ranks, experts unsplit (--etp 1): the
    attention weights split anew, the experts move, the optimizer state follows."""
    resume = ("--tp", "2", "--sp", "--ep", "2", "--etp", "1", "--steps", "4", "--load",
              ep2.root / "checkpoints" / "iter_0000002")
    done = train_here(tmp_path / "a", cache, *resume)
    assert done.returncode == 0, done.stderr
    resumed = logged(done)
    assert sorted(resumed) == [3, 4]
    assert_same_steps(resumed, ep2.steps, (3, 4))
    # step 4 follows the update that step 3 made with the resharded optimizer state: with a fresh
    # optimizer instead, step 3 (the loaded weights) is the same and step 4 is not
    fresh = train_here(tmp_path / "b", cache, *resume, "--no-load-optim")
    assert fresh.returncode == 0, fresh.stderr
    fresh_steps = logged(fresh)
    assert_same_steps(fresh_steps, ep2.steps, (3,))
    assert abs(fresh_steps[4]["loss"] - ep2.steps[4]["loss"]) > 1e-3


def test_expert_parallel_weights_load_into_a_pipeline_without_expert_parallelism(tmp_path, cache, ep2):
    """EP2 -> PP2 at EP1: Megatron keeps the expert parameters' optimizer apart only under EP, so
    the state is refused with what loads it; the weights load (the next step's forward, losses
    and routing included, is the uninterrupted run's), with a fresh optimizer."""
    checkpoint = ep2.root / "checkpoints" / "iter_0000002"
    refused = train_here(tmp_path / "a", cache, "--tp", "1", "--pp", "2", "--steps", "4", "--load", checkpoint)
    assert_one_line_refusal(refused, f"--load {checkpoint} holds the expert parameters' optimizer state apart",
                   "resume with expert parallelism (--ep 2 or more), or pass --no-load-optim")
    done = train_here(tmp_path / "b", cache, "--tp", "1", "--pp", "2", "--steps", "4", "--load", checkpoint,
                      "--no-load-optim")
    assert done.returncode == 0, done.stderr
    resumed = logged(done)
    assert sorted(resumed) == [3, 4]
    assert_same_steps(resumed, ep2.steps, (3,))


def test_a_deepseek_shaped_model_trains_and_resumes_under_another_layout(tmp_path, cache):
    """PP2 (the first stage without experts: its router statistics join the last stage's, the
    MTP layer's router among them) saves at step 2 with the MTP layer on the last stage; TP2 with
    SP resumes it: steps 3 and 4, their MTP loss and routers, are the uninterrupted run's."""
    straight = train_here(tmp_path / "pp2", cache, *DEEPSEEK, "--tp", "1", "--pp", "2", "--steps", "4",
                          "--save-interval", "2")
    assert straight.returncode == 0, straight.stderr
    steps = logged(straight)
    assert sorted(steps) == [1, 2, 3, 4] and all(set(ROUTER + MTP) <= set(values) for values in steps.values())
    assert steps[4]["loss"] < steps[1]["loss"] - 0.05 and steps[4]["mtp_1 loss"] < steps[1]["mtp_1 loss"] - 0.05
    written = [entry for entry in map(json.loads, (tmp_path / "pp2" / "metrics.jsonl").read_text().splitlines())
               if "loss" in entry]
    assert [entry["mtp_1 loss"] for entry in written] == pytest.approx([steps[s]["mtp_1 loss"] for s in (1, 2, 3, 4)],
                                                                        rel=1e-5)
    resumed = train_here(tmp_path / "tp2", cache, *DEEPSEEK, "--tp", "2", "--sp", "--steps", "4", "--load",
                         tmp_path / "pp2" / "checkpoints" / "iter_0000002")
    assert resumed.returncode == 0, resumed.stderr
    resumed_steps = logged(resumed)
    assert sorted(resumed_steps) == [3, 4]
    assert_same_steps(resumed_steps, steps, (3, 4), router=ROUTER + MTP)


def test_a_resume_into_other_experts_is_refused_before_any_rank_starts(tmp_path, cache, ep2):
    done = train_here(tmp_path, cache, "--tp", "1", "--dp", "2", "--ep", "2", "--steps", "6", "--num-experts", "8",
                      "--moe-router-topk", "3", "--load", ep2.root / "checkpoints")
    assert_one_line_refusal(done, "holds another model", "--num-experts 4 -> 8, --moe-router-topk 2 -> 3")
    assert not os.path.exists(Path(tmp_path) / "checkpoints")


# -- the examples ------------------------------------------------------------------------

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


@pytest.mark.skipif(not ships_megatron_training(), reason="megatron-core < 0.17: train is our own loop")
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


