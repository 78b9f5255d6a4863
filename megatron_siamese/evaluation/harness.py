"""lm-evaluation-harness on a Transformers model directory (an exported SiameseNorm model's
remote code included): its Python API with ``--model hf``, our local tasks on its include
path, its results table and JSON."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_siamese.evaluation.addition_task import TASKS, write_addition_tasks
from megatron_siamese.training.args import ConfigError
from megatron_siamese.training.checkpoint_files import is_checkpoint

INSTALL_HINT = "pip install 'megatron_siamese[hf]' (or: pip install 'lm-eval[hf]==0.4.13')"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class EvalPlan:
    model_dir: Optional[str]  # a Transformers directory (config.json, weights, tokenizer); None: not yet known
    tasks: List[str] = field(default_factory=lambda: ["siamese_addition"])
    limit: Optional[int] = None  # problems per task (all if None)
    batch_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    addition_digits: int = 3
    log_samples: bool = False  # keep every request's result (in the returned dict and the JSON)
    task_dirs: List[str] = field(default_factory=list)  # more task configs (lm-eval YAML) to choose from


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ConfigError([f"evaluation needs lm-evaluation-harness with Transformers ({error.name} is not installed): "
                           f"{INSTALL_HINT}"]) from None


def check(plan: EvalPlan) -> None:
    problems = []
    if plan.model_dir is not None and not os.path.exists(plan.model_dir):
        problems.append(f"--hf {plan.model_dir} does not exist: give a Transformers model directory (megatron-siamese "
                        "export writes one)")
    elif plan.model_dir is not None and not os.path.isfile(os.path.join(plan.model_dir, "config.json")):
        problems.append(f"--hf {plan.model_dir}: no config.json there; " + (
            "it is a checkpoint: give it as --load" if is_checkpoint(plan.model_dir) else
            "give a Transformers model directory (megatron-siamese export writes one)"))
    if plan.device != "cpu":
        problems += _device_problems(plan.device)
    if plan.limit is not None and plan.limit < 1:
        problems.append(f"--limit must be at least 1 (got {plan.limit})")
    if plan.batch_size < 1:
        problems.append(f"--batch-size must be at least 1 (got {plan.batch_size})")
    if not plan.tasks:
        problems.append("--tasks is empty")
    if problems:
        raise ConfigError(problems)


def _device_problems(device: str) -> List[str]:
    """What keeps torch from running on ``device`` here (torch imported only for a device other than the CPU)."""
    import torch

    from megatron_siamese.device import gpu_count

    try:
        kind = torch.device(device)
    except RuntimeError as error:
        return [f"--device {device}: {str(error).splitlines()[0]}"]
    if kind.type == "cuda" and not gpu_count():
        return [f"--device {device}: no CUDA GPU here (torch {torch.__version__}); use --device cpu"]
    if kind.type == "cuda" and kind.index is not None and kind.index >= gpu_count():
        return [f"--device {device}: there are {gpu_count()} CUDA GPUs here (cuda:0 to cuda:{gpu_count() - 1})"]
    return []


def evaluate(plan: EvalPlan) -> dict:
    """The harness's results dict (``results``, ``configs``, ``versions``, ... and ``samples``
    with log_samples) for ``plan``'s tasks."""
    check(plan)
    if _local(plan.tasks, plan.task_dirs):  # nothing to download: no library may try (and wait on the network)
        for name, value in OFFLINE.items():  # read when huggingface_hub and datasets are imported
            os.environ.setdefault(name, value)
    require_lm_eval()
    from lm_eval import simple_evaluate

    with tempfile.TemporaryDirectory(prefix="siamese-tasks-") as tasks_dir:
        write_addition_tasks(tasks_dir, digits=plan.addition_digits)
        manager = _task_manager([tasks_dir, *plan.task_dirs], plan.tasks)
        results = simple_evaluate(
            model="hf",
            model_args={"pretrained": os.path.abspath(plan.model_dir), "trust_remote_code": True,
                        "dtype": plan.dtype},
            tasks=list(plan.tasks), task_manager=manager, limit=plan.limit, batch_size=plan.batch_size,
            device=plan.device, log_samples=plan.log_samples, bootstrap_iters=0,
        )
    if results is None:  # only ranks other than 0 of a multi-process run get None
        raise RuntimeError("lm-evaluation-harness returned no results")
    return results


def _task_manager(include_path: List[str], tasks: List[str]):
    """The harness's task index: ours and ``include_path``'s alone when they hold every task
    asked for, else the harness's own thousands of task configs too."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path, include_defaults=not _local(tasks, include_path[1:]))
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ConfigError([f"--tasks: unknown {', '.join(unknown)} (ours: {', '.join(TASKS)}; or any "
                           "lm-evaluation-harness task)"])
    return manager


def _local(tasks: List[str], task_dirs: List[str]) -> bool:
    """Whether every task is ours or one of ``task_dirs``' (``write_task`` names a config after its task)."""
    theirs = {name[: -len(".yaml")] for directory in task_dirs for name in os.listdir(directory)
              if name.endswith(".yaml")}
    return all(task in TASKS or task in theirs for task in tasks)


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str) -> None:
    from lm_eval.utils import handle_non_serializable

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(results, out, indent=2, default=handle_non_serializable)
        out.write("\n")
