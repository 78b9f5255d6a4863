"""Context parallelism's sequence split (``context_parallel.py``): Megatron's load-balanced chunks,
the order gathered rows arrive in, and the batch each CP rank trains on. The attention that
uses them is checked against one rank in test_check.py (cp layouts, and a planted wrong order)."""

import pytest
import torch

from megatron_siamese.context_parallel import (
    batch_on_rank,
    document_mask,
    document_positions_on_rank,
    gathered_document_positions,
    gathered_positions,
    positions_on_rank,
)

pytestmark = pytest.mark.stack_independent


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_and_together_every_token_once(cp):
    seq, chunk = 8 * cp, 4
    for rank in range(cp):
        held = positions_on_rank(seq, cp, rank).tolist()
        assert held == list(range(rank * chunk, (rank + 1) * chunk)) + list(
            range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk))
    gathered = gathered_positions(seq, cp)
    assert sorted(gathered.tolist()) == list(range(seq))
    # the rows of an all-gather in rank order, named by their places in the sequence
    assert gathered.tolist() == [p for rank in range(cp) for p in positions_on_rank(seq, cp, rank).tolist()]


def test_a_sequence_not_in_2cp_equal_chunks_is_refused():
    with pytest.raises(ValueError, match="multiple of 2 x cp = 4"):
        positions_on_rank(10, 2, 0)


def test_a_batch_is_split_per_token_and_the_mask_by_query_rows():
    seq, cp = 8, 2
    tokens = torch.arange(2 * seq).reshape(2, seq)
    mask = torch.arange(seq * seq).reshape(1, 1, seq, seq)
    batch = dict(tokens=tokens, labels=tokens + 100, loss_mask=torch.ones(2, seq), position_ids=None,
                 attention_mask=mask)
    parts = [batch_on_rank(batch, cp, rank) for rank in range(cp)]
    assert parts[0]["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert parts[1]["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert parts[1]["position_ids"] is None
    assert torch.equal(parts[1]["attention_mask"], mask[:, :, [2, 3, 4, 5], :])  # every key column kept
    assert batch_on_rank(batch, 1, 0) is batch


def test_a_tensor_of_unknown_layout_is_refused_not_split_along_a_guess():
    with pytest.raises(ValueError, match=r"cannot split \['segment_ids'\]"):
        batch_on_rank(dict(tokens=torch.zeros(1, 8), segment_ids=torch.zeros(1, 8)), 2, 0)


def test_packed_documents_are_each_split_into_their_own_2cp_chunks():
    bounds = torch.tensor([0, 4, 12, 16])  # documents of 4, 8 and 4 tokens
    assert document_positions_on_rank(bounds, 1, 0).tolist() == list(range(16))
    assert document_positions_on_rank(bounds, 2, 0).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert document_positions_on_rank(bounds, 2, 1).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    assert sorted(gathered_document_positions(bounds, 2).tolist()) == list(range(16))
    with pytest.raises(ValueError, match=r"packed documents of \[4, 4\] tokens do not cut into 2 x cp = 8"):
        document_positions_on_rank(bounds, 4, 0)


def test_a_document_attends_to_itself_only_causally():
    bounds = torch.tensor([0, 2, 5])
    positions = torch.arange(5)
    allowed = ~document_mask(positions, positions, bounds)[0, 0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0],
                                      [1, 1, 0, 0, 0],
                                      [0, 0, 1, 0, 0],
                                      [0, 0, 1, 1, 0],
                                      [0, 0, 1, 1, 1]]
    # queries and keys in any order (a CP rank's chunks over the gathered rows): the same pairs
    queries, keys = torch.tensor([4, 0]), torch.tensor([2, 3, 0, 1, 4])
    assert (~document_mask(queries, keys, bounds)[0, 0]).int().tolist() == [[1, 1, 0, 0, 1], [0, 0, 1, 0, 0]]


def test_a_packed_batch_is_split_per_document_and_keeps_its_bounds():
    bounds = torch.tensor([0, 4, 12, 16], dtype=torch.int32)
    batch = dict(tokens=torch.arange(16)[None], labels=torch.arange(16)[None] + 100, cu_seqlens=bounds)
    part = batch_on_rank(batch, 2, 1)
    assert part["tokens"].tolist() == [[1, 2, 6, 7, 8, 9, 13, 14]] and part["cu_seqlens"] is bounds
    with pytest.raises(ValueError, match="give it no attention_mask"):
        batch_on_rank(dict(batch, attention_mask=torch.zeros(1, 1, 16, 16, dtype=torch.bool)), 2, 0)
