"""The parallel correctness check: the CPU matrix passes, and planted bugs make it fail."""

import dataclasses
from typing import List, Sequence, Tuple

import pytest

from megatron_siamese.check.case import MOE_CASE
from megatron_siamese.check.command import DEFAULT_LAYOUTS, Row, check_job, job_size, run_check
from megatron_siamese.cli import main as cli_main
from megatron_siamese.check.step import ModelCase
from megatron_siamese.runtime.layout import parse_layout
from megatron_siamese.versions import installed_megatron_core, release


@dataclasses.dataclass(frozen=True)
class Subject:
    """One model the check runs: its case (``case.fault`` planted in its layouts), the spec it
    is built with (``SPECS``), and its layouts."""

    case: ModelCase
    spec: str
    layouts: Tuple[str, ...]


def check_subjects_job(subjects: Sequence[Subject]) -> List[List[Row]]:
    """Every rank of one job: each subject in turn (``check_job``), a single-rank run shared by
    the subjects whose cases differ only in their fault; every rank returns the rows per subject."""
    cache: dict = {}
    return [check_job(dataclasses.replace(subject.case, fault=None), [(n, parse_layout(n)) for n in subject.layouts],
                      subject.spec, subject.case.fault, cache) for subject in subjects]


def run_checks(subjects: Sequence[Subject], timeout_s: float = 600.0) -> List[List[Row]]:
    """Several models' checks in one job (its ranks start once: the tests check the baselines and
    their planted faults side by side); one list of rows per subject."""
    from megatron_siamese.runtime.job import job_world_size
    from megatron_siamese.runtime.launch import run_job

    layouts = [parse_layout(name) for subject in subjects for name in subject.layouts]  # bad names fail first
    world = job_world_size() or job_size(layouts)
    return run_job(check_subjects_job, world, list(subjects), timeout_s=timeout_s, quiet_ranks=range(world))


def rows_by_subject(subjects: dict) -> dict:
    """{subject: {layout: row}}, the subjects checked in one job."""
    rows = run_checks(list(subjects.values()))
    return {name: {row.layout: row for row in subject_rows} for name, subject_rows in zip(subjects, rows)}


def statuses(rows):
    return {row.layout: row.status for row in rows}


# A planted bug failing exactly the layouts it breaks proves the check can fail: the check's own
# comparison. The Megatron paths those layouts take pass on every stack in the matrices here.
PLANTED = pytest.mark.once("a planted bug proves the check can fail; the layouts' Megatron paths pass on every "
                           "stack in the matrices")


def test_cpu_matrix_passes():
    rows = run_check(ModelCase(), DEFAULT_LAYOUTS, "siamese")
    assert len(rows) >= 13
    assert statuses(rows) == {name: "PASS" for name in DEFAULT_LAYOUTS}


def test_stock_spec_control_passes():
    rows = run_check(ModelCase(norm="pre"), ["tp2-sp", "pp2-vpp2", "dp2-do"], "stock")
    assert set(statuses(rows).values()) == {"PASS"}


def test_bf16_matrix_passes_against_its_own_noise():
    rows = run_check(ModelCase(dtype="bf16"), ["tp2-sp", "pp2-vpp2", "dp2-do"], "siamese")
    assert set(statuses(rows).values()) == {"PASS"}


@PLANTED
def test_bf16_rule_fails_a_planted_bug():
    """The bf16 rule (each quantity within twice bf16's own single-rank noise) is what the README
    recommends on clusters: norm gradients left partial under SP land far outside that noise."""
    rows = run_check(ModelCase(dtype="bf16"), ["tp2-sp"], "siamese", fault="no-sp-flag")
    assert statuses(rows) == {"tp2-sp": "FAIL"} and "norm" in rows[0].detail


def test_hybrid_variant_matrix_passes_and_fails_a_planted_bug():
    rows = run_check(ModelCase(norm="siamese-hybrid"),
                     ["tp2", "tp2-sp", "pp2-vpp2", "dp2-do", "sel", "tp2-pp2-sp"], "siamese-hybrid")
    assert set(statuses(rows).values()) == {"PASS"}
    rows = run_check(ModelCase(norm="siamese-hybrid"), ["tp2-sp", "pp2"], "siamese-hybrid", fault="no-sp-flag")
    assert statuses(rows) == {"tp2-sp": "FAIL", "pp2": "PASS"} and "norm" in rows[0].detail


def test_qk_norm_through_the_megatron_lm_spec_object_passes_and_its_tp_reduction_is_checked():
    """--norm siamese-layer --qk-layernorm: the spec object (made before any config) normalizes
    queries and keys under TP (their gradients summed over TP ranks), PP with Megatron's own p2p,
    and the distributed optimizer; the same QK-norm with its TP reduction left out fails."""
    case = ModelCase(norm="siamese-layer", qk_layernorm=True, siamese_p2p=False)
    assert set(statuses(run_check(case, ["tp2", "pp2-vpp2", "dp2-do"], "siamese-layer")).values()) == {"PASS"}
    rows = run_check(case, ["tp2"], "siamese-layer", fault="qk-norm-unreduced")
    assert statuses(rows) == {"tp2": "FAIL"} and "layernorm" in rows[0].detail


@PLANTED
def test_depth_scale_from_local_layer_index_fails_pipeline_layouts_only():
    rows = run_check(ModelCase(), ["tp2", "dp2", "pp2", "pp2-vpp2"], "siamese",
                     fault="local-depth-scale")
    assert statuses(rows) == {"tp2": "PASS", "dp2": "PASS", "pp2": "FAIL", "pp2-vpp2": "FAIL"}
    failed = [row for row in rows if row.status == "FAIL"]
    # far outside fp32 noise (~1e-6) in losses and gradients alike
    assert all(row.loss_error > 1e-3 and row.grad_error > 1e-1 for row in failed)


@PLANTED
def test_norms_without_sequence_parallel_flag_fail_sp_layouts_only():
    """Under fully sharded data parallelism too: the SP norms' gradients are still summed over
    TP (Megatron's FSDP2 wrapper restores the flag FSDP2's DTensors would lose; Megatron-FSDP's
    shards carry it), so without the flag both fail, and FSDP without SP passes."""
    layouts = ["tp2", "tp2-sp", "tp2-dp2-sp-fsdp2", "tp2-dp2-sp-mfsdp3", "dp2-fsdp2"]
    rows = run_check(ModelCase(), layouts, "siamese", fault="no-sp-flag")
    assert statuses(rows) == {"tp2": "PASS", "tp2-sp": "FAIL", "tp2-dp2-sp-fsdp2": "FAIL", "tp2-dp2-sp-mfsdp3": "FAIL",
                              "dp2-fsdp2": "PASS"}
    assert all("norm" in row.detail for row in rows if row.status == "FAIL")


@PLANTED
def test_stream_norms_left_out_of_fsdp_fail_the_fsdp2_layouts_only():
    """The X/Y stream norms outside torch FSDP2's units: never reduced over DP, so each DP rank
    steps them with its own half of the batch. The losses stay right (the bug acts in the
    backward), the stream norms' gradients are far off; DDP, the distributed optimizer and
    Megatron-FSDP keep passing (with megatron-core >= 0.19 also its no_shard and optim
    strategies, which 0.16.1 refuses)."""
    fsdp2 = ["dp2-fsdp2", "tp2-dp2-sp-fsdp2"]
    others = ["dp2", "dp2-do", "dp2-mfsdp3"]
    if release(installed_megatron_core()) >= (0, 19, 0):
        others += ["dp2-mfsdp0", "dp2-mfsdp1"]
    rows = run_check(ModelCase(), others + fsdp2, "siamese", fault="stream-norms-outside-fsdp")
    assert statuses(rows) == {**{name: "PASS" for name in others}, **{name: "FAIL" for name in fsdp2}}
    failed = [row for row in rows if row.status == "FAIL"]
    assert all(row.loss_error < 1e-6 and row.grad_error > 0.1 and "_norm" in row.detail for row in failed)


# The baselines and the ablation in one job (its ranks start once): each model under its layouts,
# and planted faults that must fail exactly the layouts they break. Their layers' Megatron paths
# are SiameseNorm's, which the matrices above check on every stack: once.
BASELINES = pytest.mark.once("the baselines' layer code is ours; their Megatron paths are checked on every stack "
                             "by the SiameseNorm matrices")
# Each parallelism of the CPU matrix at least once, combined (a baseline's layer is Megatron's
# TransformerLayer with our norms: what could differ from SiameseNorm's paths is its norms' sums
# over TP, SP, CP and DP shards, and where the pipeline cuts it)
EVERY_KIND = ("tp2-sp", "pp2-vpp2-full", "dp2-tp2-sp-do", "tp2-pp2-vpp2-sel", "tp2-cp2-sp", "tp2-dp2-sp-fsdp2",
              "tp2-dp2-sp-mfsdp3")
BASELINE_SUBJECTS = {
    "hybridnorm": Subject(ModelCase(norm="hybridnorm"), "hybridnorm", EVERY_KIND),
    # half the layers Post-Norm: pipeline stages (and virtual stages) cut the model between them
    "mixln": Subject(ModelCase(norm="mixln", mix_ln_alpha=0.5), "mixln", EVERY_KIND + ("pp2", "pp4", "pp2-cp2")),
    "post": Subject(ModelCase(norm="post"), "post", ("tp2-sp", "pp2-vpp2", "dp2-do", "sel")),
    "mixln-moe": Subject(dataclasses.replace(MOE_CASE, norm="mixln", mix_ln_alpha=0.5), "mixln",
                         ("tp2-ep2-sp", "pp2-vpp2-ep2", "dp4-ep2-do")),
    # the paper's ablation: the hybrid variant's streams without InputNorm and depth scaling
    "ablation": Subject(ModelCase(norm="siamese-hybrid", siamese_input_norm=False, siamese_depth_scale=False),
                        "siamese-hybrid", ("tp2-sp", "pp2-vpp2", "dp2-do", "sel")),
    "value-norm-unreduced": Subject(ModelCase(norm="hybridnorm", fault="value-norm-unreduced"), "hybridnorm",
                                    ("tp2", "pp2")),
    "baseline-local-layer-number": Subject(
        ModelCase(norm="mixln", mix_ln_alpha=0.5, fault="baseline-local-layer-number"), "mixln",
        ("tp2", "pp2", "pp2-vpp2")),
}


@pytest.fixture(scope="module")
def baseline_rows():
    return rows_by_subject(BASELINE_SUBJECTS)


@BASELINES
@pytest.mark.parametrize("name", ["hybridnorm", "mixln", "post", "mixln-moe", "ablation"])
def test_the_baselines_and_the_ablation_pass_their_layouts(baseline_rows, name):
    """HybridNorm (its value norm's gradient summed over TP), Mix-LN cut by pipeline and virtual
    stages, Post-Norm, with MoE and expert parallelism, and the SiameseNorm ablation, under TP, SP,
    PP, VPP, DP, the distributed optimizer, full and selective recompute (and HybridNorm and Mix-LN
    under CP, FSDP2 and Megatron-FSDP), against one rank."""
    assert {layout: row.status for layout, row in baseline_rows[name].items()} == dict.fromkeys(
        BASELINE_SUBJECTS[name].layouts, "PASS")


@BASELINES
def test_a_value_norm_left_unreduced_over_tp_fails_tp_only(baseline_rows):
    rows = baseline_rows["value-norm-unreduced"]
    assert {layout: row.status for layout, row in rows.items()} == {"tp2": "FAIL", "pp2": "PASS"}
    assert "v_layernorm" in rows["tp2"].detail


@BASELINES
def test_norms_placed_by_the_stage_local_layer_number_fail_pipeline_layouts_only(baseline_rows):
    """Mix-LN's Post-Norm layers counted on each stage: stage 2 of pp2 starts Post-Norm again."""
    rows = baseline_rows["baseline-local-layer-number"]
    assert {layout: row.status for layout, row in rows.items()} == {"tp2": "PASS", "pp2": "FAIL", "pp2-vpp2": "FAIL"}
    assert all(rows[layout].loss_error > 1e-3 for layout in ("pp2", "pp2-vpp2"))


# DeepSeek-class models in one job: multi-token prediction, multi-latent attention, and both with
# MoE and a shared expert (DeepSeek-V3's shape), each under every layout that applies; and the
# planted faults of each feature, which must fail exactly the layouts they break.
_MLA = dict(multi_latent_attention=True, num_query_groups=None, qk_layernorm=True, q_lora_rank=16)
_DENSE_LAYOUTS = ("tp2-sp", "pp2", "pp2-vpp2", "dp2-do", "dp2-fsdp2")
DEEPSEEK_SUBJECTS = {
    "mtp": Subject(ModelCase(mtp_num_layers=1), "siamese", _DENSE_LAYOUTS),
    # queries through their own latent, latent norms, Megatron's default YaRN RoPE
    "mla": Subject(ModelCase(**_MLA), "siamese", _DENSE_LAYOUTS),
    # the Megatron-LM --spec object, which builds MLA where its config asks, with Megatron's own p2p
    # (not under TP: MLA there needs SP, which the stock final norm a --spec model gets refuses without apex);
    # queries projected directly, no latent norms
    "mla-spec-object": Subject(ModelCase(norm="siamese-layer", **{**_MLA, "qk_layernorm": False, "q_lora_rank": None},
                                         rope_type="rope", siamese_p2p=False),
                               "siamese-layer", ("pp2-vpp2", "dp2-do")),
    "deepseek": Subject(dataclasses.replace(MOE_CASE, **_MLA, mtp_num_layers=1, moe_shared_expert_intermediate_size=32,
                                            rope_type="rope"), "siamese", _DENSE_LAYOUTS + ("ep2", "tp2-ep2-sp")),
}
DEEPSEEK_FAULTS = {
    "mla-column-parallel-down-projections": Subject(
        ModelCase(**_MLA, fault="mla-column-parallel-down-projections"), "siamese", ("tp2-sp", "pp2")),
    "mtp-embedding-unsynced": Subject(ModelCase(mtp_num_layers=1, fault="mtp-embedding-unsynced"), "siamese",
                                      ("tp2-sp", "pp2", "pp2-vpp2")),
}


@pytest.fixture(scope="module")
def deepseek_rows():
    return rows_by_subject(DEEPSEEK_SUBJECTS)


@pytest.fixture(scope="module")
def deepseek_fault_rows():
    return rows_by_subject(DEEPSEEK_FAULTS)


@pytest.mark.parametrize("name", ["mtp", "mla", "mla-spec-object", "deepseek"])
def test_deepseek_class_models_pass_their_layouts(deepseek_rows, name):
    rows = deepseek_rows[name]
    assert set(rows) == set(DEEPSEEK_SUBJECTS[name].layouts)
    assert {layout: row.status for layout, row in rows.items()} == {layout: "PASS" for layout in rows}, \
        {layout: row.detail for layout, row in rows.items() if row.status != "PASS"}


@PLANTED
def test_mla_down_projections_split_over_tp_fail_tp_only(deepseek_fault_rows):
    """Megatron's local MLA spec (ColumnParallelLinear down projections, gathered over TP) leaves the
    decoupled RoPE key's gradient unsummed over TP: the package duplicates them, as TE's spec does."""
    rows = deepseek_fault_rows["mla-column-parallel-down-projections"]
    assert {layout: row.status for layout, row in rows.items()} == {"tp2-sp": "FAIL", "pp2": "PASS"}
    assert rows["tp2-sp"].loss_error < 1e-6 and rows["tp2-sp"].grad_error > 1e-2


@PLANTED
def test_mtp_embedding_left_unsynced_fails_pipeline_layouts_only(deepseek_fault_rows):
    """The MTP layers' copy of the word embedding on the last stage must be summed with the first
    stage's, as Megatron's embedding group does."""
    rows = deepseek_fault_rows["mtp-embedding-unsynced"]
    assert {layout: row.status for layout, row in rows.items()} == {"tp2-sp": "PASS", "pp2": "FAIL", "pp2-vpp2": "FAIL"}
    assert all("embedding" in rows[layout].detail for layout in ("pp2", "pp2-vpp2"))


# Context parallelism beyond the CPU matrix (which has cp2, tp2-cp2-sp, pp2-cp2, dp2-cp2-do) in
# one job: the hybrid variant, MoE with the experts over the CP ranks, MLA, virtual stages, FSDP2
# and recompute; and the planted faults, each failing exactly the CP layouts.
CP_SUBJECTS = {
    "hybrid-variant": Subject(ModelCase(norm="siamese-hybrid"), "siamese-hybrid", ("cp2", "tp2-cp2-sp")),
    "moe": Subject(MOE_CASE, "siamese", ("cp2-ep2", "tp2-cp2-ep2-sp")),
    "mla": Subject(ModelCase(**_MLA), "siamese", ("cp2", "tp2-cp2-sp")),
    "more": Subject(ModelCase(), "siamese", ("pp2-vpp2-cp2", "dp2-cp2-fsdp2", "cp2-full", "cp2-sel")),
    # packed (THD) microbatches: each document attends only to itself, split per document under CP
    "packed": Subject(ModelCase(packed_sequences=True), "siamese",
                      ("tp2-sp", "pp2", "cp2", "tp2-cp2-sp", "pp2-cp2", "dp2-cp2-do")),
    "packed-moe": Subject(dataclasses.replace(MOE_CASE, packed_sequences=True), "siamese", ("ep2", "cp2-ep2")),
}
CP_FAULTS = {
    "stream-norms-reduced-over-dp-only": Subject(ModelCase(fault="stream-norms-reduced-over-dp-only"), "siamese",
                                                 ("dp2", "cp2", "tp2-cp2-sp")),
    "cp-contiguous-chunks": Subject(ModelCase(fault="cp-contiguous-chunks"), "siamese", ("dp2", "cp2", "pp2-cp2")),
    "cp-keys-in-sequence-order": Subject(ModelCase(fault="cp-keys-in-sequence-order"), "siamese", ("dp2", "cp2")),
    "packed-cp-contiguous-chunks": Subject(ModelCase(packed_sequences=True, fault="cp-contiguous-chunks"), "siamese",
                                           ("dp2", "cp2")),
    "packed-cp-keys-in-sequence-order": Subject(ModelCase(packed_sequences=True, fault="cp-keys-in-sequence-order"),
                                                "siamese", ("dp2", "tp2-cp2-sp")),
}


@pytest.fixture(scope="module")
def cp_rows():
    return rows_by_subject(CP_SUBJECTS)


@pytest.fixture(scope="module")
def cp_fault_rows():
    return rows_by_subject(CP_FAULTS)


@pytest.mark.parametrize("name", ["hybrid-variant", "moe", "mla", "more", "packed", "packed-moe"])
def test_context_parallel_layouts_pass(cp_rows, name):
    rows = cp_rows[name]
    assert {layout: row.status for layout, row in rows.items()} == dict.fromkeys(CP_SUBJECTS[name].layouts, "PASS"), \
        {layout: row.detail for layout, row in rows.items() if row.status != "PASS"}


@PLANTED
@pytest.mark.parametrize("fault, shows", [
    ("stream-norms-reduced-over-dp-only", "_norm"),  # the losses exact, the stream norms' gradients not
    ("cp-contiguous-chunks", "losses"),
    ("cp-keys-in-sequence-order", "losses"),
    ("packed-cp-contiguous-chunks", "losses"),
    ("packed-cp-keys-in-sequence-order", "losses"),
])
def test_context_parallel_faults_fail_the_cp_layouts_only(cp_fault_rows, fault, shows):
    rows = cp_fault_rows[fault]
    assert {layout: row.status for layout, row in rows.items()} == {
        layout: "FAIL" if "cp" in layout else "PASS" for layout in CP_FAULTS[fault].layouts}
    assert all(shows in row.detail for row in rows.values() if row.status == "FAIL")


def test_cli_exit_status_and_table(capfd):  # rank 0 prints the rows: capfd sees its output, capsys would not
    status = cli_main(["check", "--layouts", "tp2-sp", "--num-layers", "2"])
    passed = capfd.readouterr()  # each run's own output, shown if it falls short
    assert status == 0 and "tolerance (fp32)" in passed.out and "  PASS" in passed.out, passed
    status = cli_main(["check", "--layouts", "tp2-sp", "--num-layers", "2", "--plant-fault", "no-sp-flag"])
    failed = capfd.readouterr()
    assert status == 1 and "  FAIL" in failed.out and "  PASS" not in failed.out, failed


@pytest.mark.stack_independent
def test_a_broken_pipe_inside_the_run_fails_it_and_keeps_what_was_printed(capfd, monkeypatch):
    """A BrokenPipeError of the run's own (a pipe to a rank or the fork server) is a failure: it
    once read as `check ... | head` closing stdout, which silenced stdout (the table already
    printed included, fd-captured or a file) and exited 0."""
    import megatron_siamese.check.command as command
    import megatron_siamese.runtime.launch as launch

    def pipe_to_a_rank_breaks(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(launch, "start_rank_server", lambda: None)
    monkeypatch.setattr(command, "run_check", pipe_to_a_rank_breaks)
    assert cli_main(["check", "--layouts", "tp2-sp", "--num-layers", "2"]) == 1
    captured = capfd.readouterr()
    assert "tolerance (fp32)" in captured.out
    assert "error: BrokenPipeError" in captured.err


@pytest.mark.stack_independent
def test_a_planted_fault_that_fails_no_layout_says_where_it_acts(capfd, monkeypatch):
    """`check --plant-fault local-depth-scale --layouts tp2` passes: the fault acts only across pipeline
    stages. That pass once came alone, reading as a check blind to the fault."""
    import megatron_siamese.check.command as command
    import megatron_siamese.runtime.launch as launch

    monkeypatch.setattr(launch, "start_rank_server", lambda: None)
    check = ["check", "--layouts", "tp2", "--num-layers", "2", "--plant-fault", "local-depth-scale"]
    for status in ("PASS", "FAIL"):
        monkeypatch.setattr(command, "run_check", lambda *args, **kwargs: [Row("tp2", 2, status)])
        assert cli_main(check) == (status == "FAIL")
        said = capfd.readouterr().err
        assert ("--plant-fault local-depth-scale failed no layout: it acts on none of these. c = sqrt(2 * local "
                "layer index): wrong on every pipeline stage but the first." in said) == (status == "PASS"), said


@pytest.mark.stack_independent
def test_a_reader_that_closed_stdout_ends_the_command_quietly_with_0(capfd, monkeypatch):
    """`megatron-siamese check --list | head -1`: stdout's reader is gone; nothing left to say."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w", buffering=1) as closed_pipe:  # line-buffered: print writes at once
        monkeypatch.setattr("sys.stdout", closed_pipe)
        assert cli_main(["check", "--list"]) == 0
        monkeypatch.undo()
        assert os.path.samestat(os.fstat(write_end), os.stat(os.devnull))  # the handler silenced it
    assert capfd.readouterr().err == ""


def test_cli_rejects_unknown_layout_before_running_anything(capsys):
    assert cli_main(["check", "--layouts", "tp2-xx,tp3"]) == 2
    err = capsys.readouterr().err
    assert "unknown part 'xx'" in err and "does not split over tp3" in err


def test_fsdp_layouts_megatron_cannot_train_are_refused_by_name_before_running_anything(capsys):
    """Megatron-LM's refusals of FSDP2 (pp, ep, the distributed optimizer), Megatron-FSDP's mesh
    without pipeline stages and its one-rank expert groups, and (megatron-core < 0.19) the
    Megatron-FSDP strategies whose failing call the message names."""
    assert cli_main(["check", "--layouts", "pp2-dp2-fsdp2,dp2-do-fsdp2,pp2-dp2-mfsdp3,dp2-mfsdp0,dp2-mfsdp1"]) == 2
    err = capsys.readouterr().err
    assert "torch FSDP2 (fsdp2) does not run with pipeline parallelism (Megatron-LM refuses it): use pp1" in err
    assert "does not run with Megatron's distributed optimizer" in err and "_get_dp_tp_mesh" in err
    old_megatron = release(installed_megatron_core()) < (0, 19, 0)
    assert ("megatron_fsdp.py:1126" in err and "param_and_grad_buffer.py:3257" in err) == old_megatron
    assert cli_main(["check", "--num-experts", "4", "--disable-bias-linear", "--layouts", "ep2-mfsdp3"]) == 2
    assert "one rank of each expert-data-parallel group" in capsys.readouterr().err


@pytest.mark.skipif(release(installed_megatron_core()) < (0, 19, 0),
                    reason="HybridModel needs megatron-core >= 0.19; the 0.19 leg of the suite runs this")
def test_hybrid_model_matrix_passes():
    """A '*-*-*-*-' HybridModel under TP+SP, PP cut at '|' (1F1B and virtual stages), DP with the
    distributed optimizer and recompute, each against one rank."""
    rows = run_check(ModelCase(model="hybrid"), ["tp2-sp", "pp2", "pp2-vpp2", "dp2-do", "full", "sel", "tp2-pp2-sp"],
                     "siamese")
    assert set(statuses(rows).values()) == {"PASS"}
    # and it fails what it should: the stack's norms without the SP flag, on the SP layout only
    rows = run_check(ModelCase(model="hybrid"), ["tp2-sp", "pp2"], "siamese", fault="no-sp-flag")
    assert statuses(rows) == {"tp2-sp": "FAIL", "pp2": "PASS"} and "norm" in rows[0].detail


def _check_whose_job_cannot_regroup(case, parsed):
    """The check on ranks whose groups cannot form again for a layout (as gloo's connection
    failures at set-up did on CI): not the layout's failure, the job's."""
    from megatron_siamese.check.command import check_job
    from megatron_siamese.runtime import job as launched

    real = launched.on_first_ranks

    def failing(size, fn, *args):
        if size == 2:
            raise launched.RegroupError("planted: the world could not form again")
        return real(size, fn, *args)

    launched.on_first_ranks = failing
    return check_job(case, parsed, "siamese", None)


def test_a_job_that_cannot_regroup_fails_the_check_instead_of_a_layout():
    from megatron_siamese.check.command import parse_layout
    from megatron_siamese.runtime.launch import RankFailed, launch

    with pytest.raises(RankFailed, match="RegroupError: planted: the world could not form again"):
        launch(_check_whose_job_cannot_regroup, 2, ModelCase(num_layers=2), [("tp2", parse_layout("tp2"))],
               timeout_s=300, quiet_ranks=range(2))
