"""The multi-process launcher reports rank failures instead of hanging."""

import os
import time

import pytest

from megatron_siamese.runtime.launch import RankFailed, launch


def _rank_and_world():
    import torch

    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _raise_on_rank_one():
    import torch

    if torch.distributed.get_rank() == 1:
        raise ValueError("planted failure")
    return "ok"


def _die_without_reporting():
    os._exit(3)  # as a crash or a killed process would: no traceback, no result


def test_launch_returns_results_in_rank_order():
    assert launch(_rank_and_world, 2) == [(0, 2), (1, 2)]


def test_a_raising_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(RankFailed, match="planted failure"):
        launch(_raise_on_rank_one, 2, timeout_s=60)


def test_a_rank_that_dies_silently_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="exited with code 3"):
        launch(_die_without_reporting, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the timeout
