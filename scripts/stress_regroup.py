"""Stress the launcher's re-forming of process groups, as the check and the HF commands do it.

Runs 4-rank gloo jobs back to back for MINUTES, each re-forming the job's world 20 times
(``on_first_ranks`` over 1, 2, 4 and 2 ranks, Megatron's groups built and torn down on each
part) and prints how many jobs failed and why. Run two at once, one per stack, to load the
machine as the two-stack test run does (docs/testing.md has the measurements):

    .venv/bin/python scripts/stress_regroup.py 5 & .venv-mcore019/bin/python scripts/stress_regroup.py 5
"""

import argparse
import time

import torch

from megatron_siamese.runtime.job import group_timeout_minutes, on_first_ranks
from megatron_siamese.runtime.launch import RankFailed, launch

PARTS = ((1, 1), (2, 2), (4, 2), (2, 1))  # (ranks, tensor-parallel size) of each part


def megatron_groups(tp: int) -> float:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             distributed_timeout_minutes=group_timeout_minutes())
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    parallel_state.destroy_model_parallel()
    return float(total)


def regroup(rounds: int) -> bool:
    for _ in range(rounds):
        for ranks, tp in PARTS:
            on_first_ranks(ranks, megatron_groups, tp)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("minutes", type=float, help="how long to keep starting jobs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of PARTS per job (default 5)")
    options = parser.parse_args()
    end = time.monotonic() + 60 * options.minutes
    jobs = failed = 0
    while time.monotonic() < end:
        jobs += 1
        try:
            launch(regroup, 4, options.rounds, timeout_s=300, quiet_ranks=range(1, 4))
        except RankFailed as error:
            failed += 1
            print(f"job {jobs} failed: {error}", flush=True)
    print(f"{jobs} jobs of {options.rounds * len(PARTS)} re-formings each, {failed} failed", flush=True)


if __name__ == "__main__":
    main()
