"""What ``megatron-siamese train`` settles before Megatron-LM's ``pretrain()`` starts: a ``--load`` of
another model refused, ``--no-load-optim`` for weights only, and a rendezvous store per restart.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def _common_state(load: str):
    """The common state of the checkpoint ``--load`` resolves to, read once (both checks below ask),
    or None where it holds none yet."""
    from megatron_siamese.training import checkpoint_files

    if checkpoint_files.holds_no_checkpoint(load):
        return None
    return checkpoint_files.common_state(checkpoint_files.resolve(load))


def checkpoint_problem(args):
    """One line refusing a ``--load`` of another model than this run builds (its scheme, say, which
    Megatron-LM does not compare); None for the same model, one that says nothing of it, or none yet."""
    import dataclasses

    from megatron_siamese.inference.saved_args import settings_from_args
    from megatron_siamese.inference.session import recorded_settings
    from megatron_siamese.training.checkpoint_settings import model_differences

    common = _common_state(args.load) if args.load else None
    if common is None:
        return None
    saved = recorded_settings(common)
    building = settings_from_args(args)
    differ = model_differences(dataclasses.asdict(saved), building) if saved and building else []
    if not differ:
        return None
    return (f"--load {args.load} holds another model than this run builds ({', '.join(differ)}; checkpoint -> this "
            "run): give the checkpoint's flags, or another --load")


def loads_weights_only(args) -> bool:
    """Whether ``--load`` names model weights alone (upcycle, import-hf: no_save_optim) and the run does
    not say so: Megatron-LM would still ask for the optimizer's state (KeyError 'optimizer')."""
    from megatron_siamese.training import checkpoint_files

    common = _common_state(args.load) if args.load and not (args.no_load_optim or args.finetune) else None
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
