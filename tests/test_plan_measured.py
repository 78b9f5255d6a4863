"""``megatron-siamese plan`` against CPU ranks: every term within 5%, and a term left out of the
plan is caught (each case the review asked to measure: bf16, FSDP2's gradients, Megatron-FSDP,
what FSDP gathers, dropout, the fused activation, recompute modules and methods).

One job runs every case of bench/plan_agreement.py's ``CASES`` (stock Pre-Norm and SiameseNorm under
single, tp2, tp2-sp, pp2, pp2-vpp2, dp2-do, dp2-fsdp2, full and selective recompute; the apart and
PyTorch paths; multi-head attention without RoPE; an MoE model under ep2) through the runtime the
check uses, measuring each rank's states,
its activations kept for backward (saved-tensor hooks), pipeline buffers (stage outputs freed once
sent, as the trainer and Megatron-LM run: a kept output fails them) and the bytes it sends
(a counter around the process groups' collectives and p2p); the plan predicts each. Three
planted faults in the plan's arithmetic each fail exactly the terms they drop.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once("the plan's arithmetic is one for every release (no term depends on it); its "
                              "layouts' Megatron paths run on every stack in the check's tests")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the measurement is a bench's
import plan_agreement  # noqa: E402
from plan_agreement import CASES, TERMS, compare, format_terms, measure  # noqa: E402

from megatron_siamese.plan import activations as plan_activations
from megatron_siamese.plan import per_gpu, recompute, states, traffic
from megatron_siamese.plan.activations import STOCK


@pytest.fixture(scope="module")
def measured():
    return measure(CASES)


def test_every_term_of_every_layout_agrees_within_5_percent(measured):
    terms = compare(CASES, measured)
    assert not [t for t in terms if not t.agrees], format_terms([t for t in terms if not t.agrees])
    assert {t.term for t in terms if t.measured} == set(TERMS)  # every term is measured somewhere, nonzero
    differences = {t.variant for t in terms if t.variant.endswith(" - stock") and t.measured}
    assert differences == {"joined - stock", "apart - stock", "pytorch - stock"}


def _y_stream_left_out_of_pipeline_buffers(monkeypatch):
    """SiameseNorm's stage inputs and outputs held h wide, as if only X crossed the stages."""
    original = per_gpu.chunk_activations

    def chunk_activations(chunk, shape, layout, impl, variant, micro_batch):
        held = original(chunk, shape, layout, impl, variant, micro_batch)
        if variant == STOCK:
            return held
        return dataclasses.replace(held, received=held.received / 2, sent=held.sent / 2)

    monkeypatch.setattr(per_gpu, "chunk_activations", chunk_activations)


def _sp_regather_left_out(monkeypatch):
    """The column-parallel linears' input all-gathered once, not again for their weight gradient."""
    monkeypatch.setitem(traffic.SUBLAYER_COLLECTIVES, traffic.ALL_GATHER, 2)


def _siamese_keeps_what_stock_keeps(monkeypatch):
    """Past its packed input, a SiameseNorm layer's norms and residuals counted as stock's: the
    attention's output z, the MLP's packed input, InputNorm's input, the ops' statistics left out."""
    original = plan_activations._streams

    def streams(shape, tokens, impl, variant, first):
        stock = original(shape, tokens, impl, STOCK, first)
        return dataclasses.replace(original(shape, tokens, impl, variant, first), rest=stock.rest)

    monkeypatch.setattr(plan_activations, "_streams", streams)


def _implementation_without(monkeypatch, **changes):
    """The plan told the check's layers compute otherwise than they do (``Implementation`` fields)."""
    original = plan_agreement.case_inputs

    def case_inputs(case, layout):
        inputs = original(case, layout)
        return dataclasses.replace(inputs, impl=dataclasses.replace(inputs.impl, **changes))

    monkeypatch.setattr(plan_agreement, "case_inputs", case_inputs)


def _softmax_copy_left_out(monkeypatch):
    """Unfused attention's probabilities counted once, in bf16: torch's fp32 softmax output left out."""
    _implementation_without(monkeypatch, softmax_fusion=True)


def _dropout_left_out(monkeypatch):
    """Dropout's masks (and the attention dropout's output) left out."""
    _implementation_without(monkeypatch, hidden_dropout=0.0, attention_dropout=0.0)


def _activation_fusion_left_out(monkeypatch):
    """The fused activation counted as Megatron's local composition (its two halves kept)."""
    _implementation_without(monkeypatch, fused_activation=False)


def _fsdp2_gradients_in_fp32(monkeypatch):
    """torch FSDP2's gradients (shards, the unsharded ones, their reduce-scatter) counted in fp32."""
    monkeypatch.setattr(states.DataParallelSharding, "grad_bytes", lambda self, param_bytes: 4)


def _megatron_fsdp_main_weights_left_out(monkeypatch):
    """Megatron-FSDP's fp32 main weights counted as any optimizer's: none for fp32 parameters."""
    original = states.chunk_states

    def chunk_states(params, layout, param_bytes, sharding, bucketed):
        return original(params, layout, param_bytes, dataclasses.replace(sharding, fsdp="none"), bucketed)

    monkeypatch.setattr(per_gpu, "chunk_states", chunk_states)


def _fsdp_root_left_out_of_gathered(monkeypatch):
    """What FSDP gathers counted for its layers only: the embedding's and the head's left out."""
    original = states.gathered_bytes
    monkeypatch.setattr(per_gpu, "gathered_bytes", lambda sharding, layers, root, head, *args: original(
        sharding, layers, 0, 0, *args))


def _moe_recomputed_by_mlp(monkeypatch):
    """Selective "mlp" recompute counted for MoE layers too (Megatron leaves their MLP alone)."""
    original = recompute.layer_recompute

    def layer_recompute(settings, moe, index_in_chunk):
        found = original(settings, moe, index_in_chunk)
        return dataclasses.replace(found, mlp=found.mlp or (moe and settings.recomputes("mlp")))

    monkeypatch.setattr(plan_activations, "layer_recompute", layer_recompute)


def _core_attention_recompute_left_out(monkeypatch):
    """Selective "core_attn" recompute counted as no recompute: the probabilities kept."""
    original = recompute.layer_recompute
    monkeypatch.setattr(plan_activations, "layer_recompute", lambda *args: dataclasses.replace(
        original(*args), core_attention=False))


def _block_recompute_taken_as_uniform(monkeypatch):
    """Full recompute's block method counted as uniform: every layer checkpointed."""
    original = recompute.checkpointed_groups
    monkeypatch.setattr(plan_activations, "checkpointed_groups", lambda settings, layers: original(
        dataclasses.replace(settings, method="uniform") if settings.full else settings, layers))


def _cp_attention_counted_as_one_ranks(monkeypatch):
    """The local context-parallel attention counted as if each rank attended over its own chunks:
    the gathered keys and values, the scores over the whole sequence and the mask left out."""
    original = plan_activations._attention
    monkeypatch.setattr(plan_activations, "_attention", lambda shape, layout, tokens, impl: original(
        shape, dataclasses.replace(layout, cp=1), tokens, impl))


def _cp_gradient_scatter_left_out(monkeypatch):
    """The keys' and values' gradients not reduce-scattered back to their CP ranks."""
    original = traffic.Traffic.add

    def add(self, kind, op, payload, group, times=1):
        if not (kind == "cp" and op == traffic.REDUCE_SCATTER):
            original(self, kind, op, payload, group, times)

    monkeypatch.setattr(traffic.Traffic, "add", add)


def _differences(layout, variant):
    return variant.endswith(" - stock") and "moe" not in layout  # MoE activations: by the routers' choices


def _in(*parts, differences=True):
    """A case whose label has each of ``parts`` (its stock-difference row too, unless not ``differences``)."""
    return lambda layout, variant: (all(part in layout for part in parts)
                                    and (differences or not variant.endswith(" - stock")))


def _sp(layout, variant):
    return "sp" in layout.split("+")[0].split("-") and not variant.endswith(" - stock")


PLANTED = {  # the fault, the terms it drops, the cases they must fail in, and those they may fail in
    "y stream left out of the pipeline buffers": (
        _y_stream_left_out_of_pipeline_buffers, "pipeline",
        lambda layout, variant: layout.startswith("pp") and variant != STOCK, None),
    "sp re-gather left out": (_sp_regather_left_out, "sp", _sp, None),
    # every difference from stock fails; the totals where what is left out is over 5% of them (the
    # apart and PyTorch paths; the joined path then misses only statistics: why differences are compared)
    "siamese keeps what stock keeps": (
        _siamese_keeps_what_stock_keeps, "activations", _differences,
        lambda layout, variant: variant != STOCK),
    "torch's fp32 softmax output left out": (
        _softmax_copy_left_out, "activations", _in("+bf16", differences=False), None),
    "dropout's masks left out": (_dropout_left_out, "activations", _in("+dropout"), None),
    "the fused activation counted unfused": (
        _activation_fusion_left_out, "activations", _in("+fused-act", differences=False), None),
    "FSDP2's gradients counted in fp32": (
        _fsdp2_gradients_in_fp32, ("grads", "gathered", "dp"), _in("dp2-fsdp2+bf16"), None),
    "Megatron-FSDP's fp32 main weights left out": (
        _megatron_fsdp_main_weights_left_out, "optimizer", _in("mfsdp", differences=False), _in("mfsdp")),
    "FSDP's root left out of what it gathers": (
        _fsdp_root_left_out_of_gathered, "gathered", _in("fsdp", differences=False), _in("fsdp")),
    "MoE layers recomputed by selective mlp": (
        _moe_recomputed_by_mlp, "activations", _in("ep2-sel+moe", differences=False), None),
    "core attention recompute left out": (
        _core_attention_recompute_left_out, "activations", _in("sel=core_attn", differences=False), None),
    "cp attention counted as one rank's": (
        # under core_attn recompute the gathered keys are only part of one layer's recomputation: may
        _cp_attention_counted_as_one_ranks, "activations",
        lambda layout, variant: _in("cp2", differences=False)(layout, variant) and "core_attn" not in layout,
        _in("cp2", differences=False)),
    "cp gradient scatter left out": (_cp_gradient_scatter_left_out, "cp", _in("cp2", differences=False), None),
    "block recompute taken as uniform": (
        _block_recompute_taken_as_uniform, "activations", _in("fullblock", differences=False), _in("fullblock")),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_term_left_out_of_the_plan_fails_where_it_counts(measured, monkeypatch, name):
    plant, terms, must, may = PLANTED[name]
    terms = (terms,) if isinstance(terms, str) else terms
    runs = {(t.layout, t.variant) for t in compare(CASES, measured)}
    plant(monkeypatch)
    found = {(t.layout, t.variant, t.term) for t in compare(CASES, measured) if not t.agrees}
    required = {(layout, variant, term) for layout, variant in runs if must(layout, variant) for term in terms}
    allowed = {(layout, variant, term) for layout, variant in runs if (may or must)(layout, variant) for term in terms}
    assert required and required <= found <= allowed, sorted(found ^ required)


def test_a_measured_case_runs_with_its_planted_fault_and_the_next_case_without_it(measured):
    """A case's model fault is planted for its layout only (``check.step.with_case_fault``): the
    stream norms left out of torch FSDP2's units stay whole on every rank, so the faulty model
    holds more weights per rank; the sound case measured after it in the same job holds exactly
    what it holds in the module's job (the fault was undone)."""
    from megatron_siamese.check.case import ModelCase

    faulty, sound = ModelCase(fault="stream-norms-outside-fsdp"), ModelCase()
    after_fault = measure([(faulty, "dp2-fsdp2"), (sound, "dp2-fsdp2")])
    alone = measured[CASES.index((sound, "dp2-fsdp2"))]
    assert after_fault[0][0].weights > after_fault[1][0].weights

    def held_and_sent(rank):  # a scalar's group may be booked under another kind in another job: the total
        return rank.weights, rank.grads, rank.optimizer, rank.gathered, rank.activations, sum(rank.sent.values())

    assert [held_and_sent(rank) for rank in after_fault[1]] == [held_and_sent(rank) for rank in alone]
