"""Mixture-of-experts layers split over ranks (expert parallelism with TP, SP, PP, DP and the
distributed optimizer) against one rank: the check's MoE matrix, the stock control, a planted
MoE bug the check catches, and how expert parameters map between local and global names."""

import dataclasses
import json

import pytest
import torch

from megatron_siamese.check import MOE_LAYOUTS
from megatron_siamese.check.case import MOE_CASE
from megatron_siamese.check.command import run_check
from megatron_siamese.check.matrix import whole_job_layouts
from megatron_siamese.check.sharding import global_parameters, is_expert, seed_parameters, seeded_tensor
from megatron_siamese.cli import main as cli_main
from megatron_siamese.runtime.layout import parse_layout


def statuses(rows):
    return {row.layout: row.status for row in rows}


def test_moe_matrix_passes():
    """Alternating MoE and dense layers (4 experts, top-2, aux loss and z-loss, the alltoall
    dispatcher) under every MoE layout: every loss, gradient and updated parameter, experts
    compared per global expert."""
    rows = run_check(MOE_CASE, MOE_LAYOUTS, "siamese")
    assert statuses(rows) == {name: "PASS" for name in MOE_LAYOUTS}


def test_allgather_dispatcher_passes():
    rows = run_check(dataclasses.replace(MOE_CASE, moe_token_dispatcher_type="allgather"),
                     ["ep4", "tp2-ep2-sp", "dp4-ep2-do"], "siamese")
    assert set(statuses(rows).values()) == {"PASS"}


def test_stock_moe_control_passes():
    """Megatron's own Pre-Norm MoE model under the same rules: the check itself is sound for MoE."""
    rows = run_check(dataclasses.replace(MOE_CASE, norm="pre"), ["tp2-ep2-sp", "pp2-vpp2-ep2", "dp4-ep2-do"], "stock")
    assert set(statuses(rows).values()) == {"PASS"}


@pytest.mark.parametrize("fault, passes, fails, names", [
    # experts left tagged for the dense all-reduce: right on dp2 (experts replicated), wrong on
    # ep2 (the same two ranks, each holding two experts: different experts' gradients summed)
    ("experts-reduced-over-dp", "dp2", "ep2", "mlp.experts.local_experts"),
    # the aux loss's gradient divided by the DP size again: every DP > 1 layout, and everything
    # upstream of the routers
    ("aux-loss-over-dp", "pp2", "dp2", "decoder.layers.0."),
])
def test_planted_moe_bugs_fail_exactly_the_layouts_they_break(fault, passes, fails, names, tmp_path, capfd):
    """The losses stay right (both bugs act after them, in the backward); the gradients do not."""
    report = tmp_path / "check.json"
    code = cli_main(["check", "--num-experts", "4", "--disable-bias-linear", "--layouts", f"{passes},{fails}",
                     "--plant-fault", fault, "--json", str(report)])
    assert code == 1
    assert "Traceback" not in capfd.readouterr().err
    rows = {row["layout"]: row for row in json.loads(report.read_text())["rows"]}
    assert rows[passes]["status"] == "PASS" and rows[fails]["status"] == "FAIL"
    assert rows[fails]["loss_error"] < 1e-6 and rows[fails]["grad_error"] > 1e-2
    assert names in rows[fails]["detail"]


@pytest.mark.stack_independent
def test_moe_layouts_the_model_cannot_run_are_refused_before_any_rank_starts(capsys):
    assert cli_main(["check", "--num-experts", "4", "--layouts", "tp2,ep3"]) == 2
    err = capsys.readouterr().err
    assert ("tp2: MoE layers under tensor parallelism (tp2) need sequence parallelism: add it ('sp' in the "
            "layout's name)") in err
    assert "--num-experts 4 does not split over ep3" in err
    assert "--add-bias-linear with MoE layers" in err and "--disable-bias-linear" in err
    assert cli_main(["check", "--layouts", "ep2"]) == 2
    err += capsys.readouterr().err
    assert "expert parallelism (ep2) splits MoE layers: add --num-experts N" in err
    assert "Traceback" not in err


@pytest.mark.stack_independent
def test_a_large_job_checks_an_moe_model_with_its_experts_over_the_data_parallel_ranks():
    dense, moe = whole_job_layouts(16), whole_job_layouts(16, num_experts=8)
    assert set(dense) < set(moe)  # the dense splits, and each once more with experts
    added = [parse_layout(name) for name in moe if name not in dense]
    assert {"dp16-ep8-do", "tp2-ep8-sp-do", "tp8-ep2-sp-do", "pp2-vpp2-ep8-do"} <= {layout.name for layout in added}
    assert all(layout.world_size == 16 and layout.dp % layout.ep == 0 for layout in added)


class _Layer(torch.nn.Module):
    def __init__(self, layer_number, ep_rank, num_local, expert_tp):
        super().__init__()
        self.layer_number = layer_number
        self.mlp = torch.nn.Module()
        self.mlp.local_expert_indices = [ep_rank * num_local + k for k in range(num_local)]
        self.mlp.router = torch.nn.Linear(8, 4, bias=False)
        self.mlp.experts = torch.nn.Module()
        self.mlp.experts.local_experts = torch.nn.ModuleList(torch.nn.Linear(8, 6 // expert_tp, bias=False)
                                                             for _ in range(num_local))
        for expert in self.mlp.experts.local_experts:  # a column-parallel expert weight, as Megatron tags it
            expert.weight.tensor_model_parallel, expert.weight.partition_dim = True, 0


def _chunk(ep_rank, expert_tp=1):
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([_Layer(layer_number=3, ep_rank=ep_rank, num_local=2,
                                                       expert_tp=expert_tp)])
    return chunk


@pytest.mark.stack_independent
def test_local_experts_are_named_and_seeded_as_global_experts():
    """Local expert K on EP rank r is global expert r * num_local + K; its weights are cut over
    the expert TP group, not the attention's."""
    names = [name for name, _ in global_parameters(_chunk(ep_rank=1))]
    assert names == ["decoder.layers.2.mlp.router.weight", "decoder.layers.2.mlp.experts.local_experts.2.weight",
                     "decoder.layers.2.mlp.experts.local_experts.3.weight"]
    assert [is_expert(name) for name in names] == [False, True, True]
    assert is_expert("decoder.layers.0.mlp.experts.linear_fc1.weight3")  # TEGroupedMLP's
    chunk = _chunk(ep_rank=1, expert_tp=2)
    seed_parameters([chunk], 7, tp_rank=0, tp=4, zero_centered_gamma=False, expert_tp_rank=1, expert_tp=2)
    full = seeded_tensor("decoder.layers.2.mlp.experts.local_experts.3.weight", (6, 8), 7)
    assert torch.equal(chunk.decoder.layers[0].mlp.experts.local_experts[1].weight, full[3:])
