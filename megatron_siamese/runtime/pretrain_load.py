"""What ``megatron-siamese train`` settles about the checkpoint and the store before Megatron-LM's
``pretrain()`` starts (runtime/pretrain.py): a ``--load`` of another model refused by name, a
``--load`` of model weights only given ``--no-load-optim``, and under torchrun a rendezvous store of
this restart attempt's own."""

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
    """One line refusing ``--load`` of a checkpoint whose model is another than this run builds (its
    scheme, say, which Megatron-LM's own argument check does not compare), naming each difference;
    None where it is the same model, says nothing of its model, or is not there yet (an empty
    ``--save`` directory: Megatron-LM starts from scratch)."""
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
    """Whether ``--load`` names a checkpoint of model weights alone (what upcycle and import-hf
    write: its args say no_save_optim), and the run does not say so itself. Megatron-LM then skips
    the optimizer's state in what it reads but still asks for it (KeyError 'optimizer'), so such a
    run gets ``--no-load-optim``: a fresh optimizer from those weights."""
    from megatron_siamese.training import checkpoint_files

    common = _common_state(args.load) if args.load and not (args.no_load_optim or args.finetune) else None
    return common is not None and bool(getattr(checkpoint_files.saved_args(common), "no_save_optim", False))


def restart_store(args):
    """Under torchrun, the rendezvous store of this attempt alone, or None (Megatron's env:// init).

    torchrun's agent serves one store for every restart of its workers (``--max-restarts``), and
    torch's env:// init gives each worker a plain client of it (torch 2.14's rendezvous.py: "a new
    TCPStore for every retry", which the agent no longer makes), so a restarted rank reads what the
    failed attempt's ranks left there: gloo dialled the address of a dead rank ("Connection
    refused" in connectFullMesh, or a hang while the key was read before being rewritten; NCCL's
    unique id alike, pytorch/pytorch#167288). Each attempt gets its own prefix, as torch did."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    import torch

    from megatron_siamese.runtime.job import restart_count

    agents = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return torch.distributed.PrefixStore(f"/worker/attempt_{restart_count()}", agents)
