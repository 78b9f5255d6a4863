"""The training command on the embedded corpus (a few steps, TP=2 on CPU)."""

import math

from megatron_siamese.training.trainer import TrainArgs, train


def test_tp2_training_reduces_loss(tmp_path):
    args = TrainArgs(
        tp=2, steps=12, warmup_steps=2, eval_interval=6, eval_iters=2, num_layers=2,
        hidden_size=64, seq_length=64, micro_batch_size=4, global_batch_size=8,
        cache_dir=str(tmp_path / "cache"), output_dir=str(tmp_path / "run"), progress=False,
    )
    summary = train(args)
    assert summary.steps_done == 12
    # starts near a uniform guess over the padded byte vocabulary, then learns
    assert abs(summary.train_losses[0] - math.log(264)) < 0.2
    assert summary.train_losses[-1] < summary.train_losses[0] - 1.0
    assert sorted(summary.val_losses) == [6, 12]
    assert summary.val_losses[12] < summary.val_losses[6] < summary.train_losses[0]
