"""``megatron-siamese plan`` against CPU ranks: every term within 5%, and a term left out of the
plan is caught.

One job runs every case of ``check/plan_agreement.CASES`` (stock Pre-Norm and SiameseNorm under
single, tp2, tp2-sp, pp2, pp2-vpp2, dp2-do, dp2-fsdp2, full and selective recompute; the apart and
PyTorch paths; multi-head attention without RoPE; an MoE model under ep2) through the runtime the
check uses, measuring each rank's states,
its activations kept for backward (saved-tensor hooks), pipeline buffers (stage outputs freed once
sent, as the trainer and Megatron-LM run: a kept output fails them) and the bytes it sends
(a counter around the process groups' collectives and p2p); the plan predicts each. Three
planted faults in the plan's arithmetic each fail exactly the terms they drop.
"""

import dataclasses

import pytest

from megatron_siamese.check.plan_agreement import CASES, TERMS, compare, format_terms, measure
from megatron_siamese.plan import activations as plan_activations
from megatron_siamese.plan import per_gpu, traffic
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


def _differences(layout, variant):
    return variant.endswith(" - stock") and "moe" not in layout  # MoE activations: by the routers' choices


PLANTED = {  # the fault, the term it drops, the cases that term must fail in, and those it may fail in
    "y stream left out of the pipeline buffers": (
        _y_stream_left_out_of_pipeline_buffers, "pipeline",
        lambda layout, variant: layout.startswith("pp") and variant != STOCK, None),
    "sp re-gather left out": (
        _sp_regather_left_out, "sp",
        lambda layout, variant: layout.startswith("tp2-sp") and not variant.endswith(" - stock"), None),
    # every difference from stock fails; the totals where what is left out is over 5% of them (the
    # apart and PyTorch paths; the joined path then misses only statistics: why differences are compared)
    "siamese keeps what stock keeps": (
        _siamese_keeps_what_stock_keeps, "activations", _differences,
        lambda layout, variant: variant != STOCK),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_term_left_out_of_the_plan_fails_where_it_counts(measured, monkeypatch, name):
    plant, term, must, may = PLANTED[name]
    runs = {(t.layout, t.variant) for t in compare(CASES, measured)}
    plant(monkeypatch)
    found = {(t.layout, t.variant, t.term) for t in compare(CASES, measured) if not t.agrees}
    required = {(layout, variant, term) for layout, variant in runs if must(layout, variant)}
    allowed = {(layout, variant, term) for layout, variant in runs if (may or must)(layout, variant)}
    assert required and required <= found <= allowed, sorted(found ^ required)
