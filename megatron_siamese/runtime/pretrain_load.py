"""What ``megatron-siamese train`` settles before Megatron-LM's ``pretrain()`` starts: a ``--load`` of
another model, or one Megatron-LM would not load, refused, ``--no-load-optim`` for weights only, and
a rendezvous store per restart.
"""

from __future__ import annotations

import functools
import os


def loaded_checkpoint(load: str, ckpt_step=None):
    """The checkpoint Megatron-LM's loop loads for ``--load`` (and ``--ckpt-step``), or None
    where it starts from scratch (a requeue's first start). It reads ``load``'s tracker, or
    ``load/iter_<ckpt-step>``, and nothing else: where ``load`` names checkpoints some other way (one
    iter_<N> itself, a run's directory, an unrecorded save) it would start from random without a word,
    so that is refused here, naming the flags that load it."""
    from megatron_siamese.training import checkpoint_files as files

    if ckpt_step:
        wanted = os.path.join(load, files.iteration_dir(ckpt_step))
        if not os.path.isdir(wanted) or files.missing_files(wanted):
            raise files.CheckpointError(f"--ckpt-step {ckpt_step}: there is no complete {wanted}; "
                                        f"{files.complete_in(load)}")
        return wanted
    if os.path.isfile(os.path.join(load, files.TRACKER)):
        return files.resolve(load)
    step = files.step_of(os.path.basename(os.path.normpath(load)))
    if step is not None or os.path.isfile(os.path.join(load, "metadata.json")):
        parent = os.path.dirname(os.path.normpath(load)) or "."
        how = f"--load {parent} --ckpt-step {step}" if step is not None else f"--load {parent} --ckpt-step N"
        raise files.CheckpointError(f"--load {load} is one checkpoint; Megatron-LM's loop loads from the directory "
                                    f"that holds them and would start from random: {how}")
    run_checkpoints = os.path.join(load, files.RUN_CHECKPOINTS)
    if not files.holds_no_checkpoint(run_checkpoints):
        raise files.CheckpointError(f"--load {load} is a run's directory; Megatron-LM's loop would start from random: "
                                    f"--load {run_checkpoints}")
    complete = files.complete_dirs(load)
    if complete:
        newest = [name for name in complete if files.ITER_DIR.match(name)][-1:]
        how = (f"--ckpt-step {files.step_of(newest[0])} loads {newest[0]}, the newest complete one" if newest else
               "it reads its own iter_<N> checkpoints only, and these are an earlier release's step_<N>")
        raise files.CheckpointError(f"--load {load} records no checkpoint (no `{files.TRACKER}`: the job stopped "
                                    f"before its last save was recorded), so Megatron-LM's loop would start from "
                                    f"random: {how}")
    return None


@functools.lru_cache(maxsize=1)
def _common_state(load: str, ckpt_step=None):
    """The common state of the checkpoint Megatron-LM loads, read once (both checks below ask), or
    None where it starts from scratch."""
    from megatron_siamese.training import checkpoint_files

    checkpoint = loaded_checkpoint(load, ckpt_step)
    return None if checkpoint is None else checkpoint_files.common_state(checkpoint)


def checkpoint_problem(args):
    """One line refusing a ``--load`` of another model than this run builds (its scheme, say, which
    Megatron-LM does not compare); None for the same model, one that says nothing of it, or none yet."""
    import dataclasses

    from megatron_siamese.inference.saved_args import settings_from_args
    from megatron_siamese.inference.session import recorded_settings
    from megatron_siamese.training.checkpoint_files import CheckpointError, iteration
    from megatron_siamese.training.checkpoint_settings import model_differences

    requeue = args.save and os.path.realpath(args.load or "") == os.path.realpath(args.save)
    if args.load and "://" not in args.load and not os.path.exists(args.load) and not requeue:  # msc://: not a path
        return (f"--load {args.load} does not exist (Megatron-LM's loop would start from random): give an existing "
                "checkpoint directory, or the --save directory to requeue (a first start finds none), or no --load")
    try:
        common = _common_state(args.load, args.ckpt_step) if args.load else None
    except CheckpointError as error:
        return str(error)
    if common is None:
        if not args.load or requeue or "://" in args.load:  # none yet: a requeue's first start
            return None
        transformers = os.path.isfile(os.path.join(args.load, "config.json"))
        return (f"--load {args.load} holds no checkpoint (Megatron-LM's loop would start from random): " + (
            f"it is a Transformers model directory; `megatron-siamese import-hf --hf {args.load} --output-dir DIR` "
            "makes a checkpoint of it" if transformers else
            "give a checkpoint directory, or the --save directory to requeue (a first start finds none), or no --load"))
    step = iteration(common)
    if args.train_iters is not None and step > args.train_iters and not args.finetune:
        return (f"--load {args.load} is at iteration {step}, past --train-iters {args.train_iters}: give a larger "
                "--train-iters to train on (Megatron-LM's loop would fail, or do nothing)")
    saved = recorded_settings(common)
    building = settings_from_args(args)
    differ = model_differences(dataclasses.asdict(saved), building) if saved and building else []
    if not differ:
        return None
    upcycle = (f"; a Pre-Norm checkpoint becomes an equivalent SiameseNorm one through `megatron-siamese upcycle "
               f"--load {args.load} --output-dir DIR`" if (saved.norm, building.norm) == ("pre", "siamese") else "")
    return (f"--load {args.load} holds another model than this run builds ({', '.join(differ)}; checkpoint -> this "
            f"run): give the checkpoint's flags, or another --load{upcycle}")


def loads_weights_only(args) -> bool:
    """Whether ``--load`` names model weights alone (upcycle, import-hf: no_save_optim) and the run does
    not say so: Megatron-LM would still ask for the optimizer's state (KeyError 'optimizer')."""
    from megatron_siamese.training import checkpoint_files

    common = _common_state(args.load, args.ckpt_step) if args.load and not (args.no_load_optim or args.finetune) else None
    return common is not None and bool(getattr(checkpoint_files.saved_args(common), "no_save_optim", False))


def restart_store(args):
    """Under torchrun, the rendezvous store of this attempt alone, or None (Megatron's env:// init).

    torchrun's agent serves one store for every restart, so a restarted rank read what the failed
    attempt's ranks left there: a dead rank's gloo address ("Connection refused" in connectFullMesh, or a
    hang; NCCL's unique id alike, pytorch/pytorch#167288). Each attempt gets its own prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    import torch

    from megatron_siamese.runtime.job import restart_count

    agents = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return torch.distributed.PrefixStore(f"/worker/attempt_{restart_count()}", agents)
