"""Megatron-LM's --ckpt-fully-parallel-save and --ckpt-fully-parallel-load (issue 44), under those
names: the data-parallel ranks share the writing (and reading) of the shards they hold alike.

Saved at dp 2 with it, each rank writes its part of the replicated weights; without it the first
data-parallel rank writes them all (the other writes no file). Loaded with it, each rank reads
its part of the shards and receives the rest from the other; without it each reads all it holds
(the fault_injection sitecustomize counts the bytes each rank reads). Either checkpoint resumes,
with or without the fully parallel load, to the same losses, bitwise."""

import os
from pathlib import Path

from cli_runs import cli, cli_here, train_losses

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "100000", "--no-progress",
         "--tp", "1", "--dp", "2"]
SAVED_AT, RESUMED_TO = 4, 6


def train(output, cache, *args):
    done = cli_here("train", *SMALL, "--cache-dir", cache, "--output-dir", output, *map(str, args))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


FAULTS = str(Path(__file__).parent / "fault_injection")  # sitecustomize: the bytes each rank reads


def written_by_rank(checkpoint):
    """Bytes of the shard files each rank wrote (torch_dist names them __<rank>_<n>.distcp)."""
    sizes = {}
    for shard in checkpoint.glob("*.distcp"):
        rank = int(shard.name.split("_")[2])
        sizes[rank] = sizes.get(rank, 0) + shard.stat().st_size
    return sizes


def losses_after_resume(output):
    return [loss for step, loss in sorted(train_losses(output).items()) if step > SAVED_AT]


def test_fully_parallel_save_and_load_share_the_files_and_either_checkpoint_resumes_alike(tmp_path, corpus_cache):
    runs = {}
    for mode, flag in (("parallel", "--ckpt-fully-parallel-save"), ("first-rank", "--no-ckpt-fully-parallel-save")):
        runs[mode] = tmp_path / mode
        train(runs[mode], corpus_cache, "--steps", RESUMED_TO, "--exit-interval", SAVED_AT, flag)
    sizes = {mode: written_by_rank(output / "checkpoints" / f"iter_{SAVED_AT:07d}") for mode, output in runs.items()}
    assert set(sizes["first-rank"]) == {0}, sizes  # Megatron's default save: the first replica writes
    shared = sizes["parallel"]
    assert set(shared) == {0, 1} and max(shared.values()) < 1.5 * min(shared.values()), sizes
    assert sum(shared.values()) < 1.1 * sum(sizes["first-rank"].values()), sizes  # shared, not duplicated
    resumed, read = [], {}
    for mode, load_flags in (("parallel", ["--ckpt-fully-parallel-load"]), ("first-rank", [])):
        output, reads = runs[mode], tmp_path / f"{mode}-reads"
        # a process of its own, whose fork server (and so its ranks) runs the sitecustomize
        done = cli("train", *SMALL, "--cache-dir", corpus_cache, "--output-dir", output, "--steps", RESUMED_TO,
                   "--load", output / "checkpoints", *load_flags,
                   env={"PYTHONPATH": os.pathsep.join([FAULTS, os.environ.get("PYTHONPATH", "")]),
                        "MEGATRON_SIAMESE_TEST_READS": str(reads)})
        assert done.returncode == 0, done.stderr[-3000:]
        resumed.append(losses_after_resume(output))
        read[mode] = {}
        for line in reads.read_text().splitlines():
            rank, size = map(int, line.split())
            if rank >= 0:  # not the launcher's look at the checkpoint's settings (megatron-core 0.19)
                read[mode][rank] = read[mode].get(rank, 0) + size
    assert len(resumed[0]) == RESUMED_TO - SAVED_AT and resumed[0] == resumed[1]
    alone, shared = read["first-rank"], read["parallel"]
    assert set(alone) == set(shared) == {0, 1} and alone[0] == alone[1], read  # each reads all it holds
    assert max(shared.values()) < 0.75 * alone[0] and sum(shared.values()) < 1.1 * alone[0], read  # halves
