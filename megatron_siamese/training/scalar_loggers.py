"""TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``), as
Megatron-LM's ``training_log`` feeds them: the same scalar names ("lm loss", "learning-rate",
"grad-norm", "batch-size", "loss-scale", "lm loss validation", each also "... vs samples" on
TensorBoard), every step, from rank 0. Each package is imported only when its flag is given;
``missing_packages`` names the one a run asks for but this environment lacks, before training.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, List

from megatron_siamese.training.args import TrainArgs


def missing_packages(args: TrainArgs) -> List[str]:
    found = []
    if args.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        found.append(f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package, which is not installed: "
                     "pip install tensorboard (or leave the flag out)")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        found.append(f"--wandb-project {args.wandb_project} needs the wandb package, which is not installed: "
                     "pip install wandb (or leave the flag out)")
    return found


class TensorBoard:
    def __init__(self, directory: str, resumed_at: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides what the interrupted one wrote past its checkpoint (run again now)
        self.writer = SummaryWriter(log_dir=directory, purge_step=resumed_at + 1 if resumed_at else None,
                                    flush_secs=30)

    def log(self, scalars: Dict[str, float], step: int, consumed_samples: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
            self.writer.add_scalar(f"{name} vs samples", value, consumed_samples)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, args: TrainArgs, settings: dict):
        import wandb

        directory = args.wandb_save_dir or os.path.join(args.output_dir, "wandb")
        os.makedirs(directory, exist_ok=True)
        name = args.wandb_exp_name or os.path.basename(os.path.normpath(args.output_dir))
        self.wandb = wandb
        wandb.init(dir=directory, name=name, project=args.wandb_project, config=settings)

    def log(self, scalars: Dict[str, float], step: int, consumed_samples: int) -> None:
        self.wandb.log({**scalars, "samples vs steps": consumed_samples}, step=step)

    def close(self) -> None:
        self.wandb.finish()
