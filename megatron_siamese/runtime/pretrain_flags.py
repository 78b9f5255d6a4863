"""What ``megatron-siamese train`` adds to a Megatron-LM command line that leaves it out (the CPU's
flags off a GPU, the embedded default job and corpus, ``--no-one-logger``), each only where not given,
and said. No torch import: the launching process counts ranks from the same flags.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from megatron_siamese.versions import speaks_for_the_job

# what a CPU run needs that a GPU run does not (no NCCL; no TE or apex for the fused norm, the
# gradient-accumulation fusion and the RoPE fusion; no TE layers; no CUDA kernel for the masked
# softmax of a bf16/fp16 run): added unless the command line says otherwise
CPU_FLAGS = (("--distributed-backend", "gloo"), ("--transformer-impl", "local"), ("--no-persist-layer-norm",),
             ("--no-gradient-accumulation-fusion",), ("--no-rope-fusion",), ("--no-masked-softmax-fusion",))


# where the data comes from when the command line names none (Megatron-LM's data flags)
DATA_SOURCE_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
                     "--data-args-path", "--per-split-data-args-path", "--sft-mock-dataset-config-json",
                     "--yaml-cfg")  # (a YAML configuration gives every argument itself)
TOKENIZER_FILES = ("--vocab-file", "--merge-file", "--tokenizer-model")  # read only by a --tokenizer-type
CACHE_VARIABLE = "MEGATRON_SIAMESE_CACHE"


def flag_value(argv: list, flag: str):
    """The value ``argv`` gives ``flag`` (``--flag value`` or ``--flag=value``; the last one given), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def byte_data_flags(prefix: str) -> list:
    """An indexed dataset of byte tokens as Megatron-LM's flags: split 98/2 by document, read by a
    NullTokenizer over the byte tokenizer's ids (bytes 0-255, end of document 256, padding 257)."""
    from megatron_siamese.data.corpus import ByteTokenizer

    tokenizer = ByteTokenizer()
    return ["--data-path", prefix, "--split", "98,2,0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(tokenizer.vocab_size), "--null-tokenizer-eod-id", str(tokenizer.eod), "--null-tokenizer-pad-id",
            str(tokenizer.pad)]


def embedded_data_flags(argv: list, given: set) -> list:
    """The embedded corpus as Megatron-LM's flags, each only where not given; every rank builds or
    waits for the one corpus (the cache directory's lock)."""
    from megatron_siamese.data.corpus import ByteTokenizer, embedded_corpus

    vocab_size = ByteTokenizer().vocab_size
    kind, vocab = flag_value(argv, "--tokenizer-type"), flag_value(argv, "--vocab-size")
    mismatch = (f"--tokenizer-type {kind}" if kind not in (None, "NullTokenizer") else
                f"--vocab-size {vocab}" if vocab is not None and not (vocab.isdigit() and int(vocab) >= vocab_size)
                else None)
    if mismatch:
        refuse([f"the embedded corpus (no --data-path given) is byte tokens, read with --tokenizer-type "
                f"NullTokenizer --vocab-size {vocab_size} (or more); got {mismatch}. Give --data-path for data of your "
                "own tokenizer."])
    flags = byte_data_flags(embedded_corpus(os.environ.get(CACHE_VARIABLE, ".cache/megatron_siamese")))
    pairs = zip(flags[::2], flags[1::2])
    return [word for flag, value in pairs if flag not in given for word in (flag, value)]


# the embedded default job (scripts/run.sh's) where the command line names no model (no --num-layers):
# a 4-layer SiameseNorm GPT of width 128 on 128-token sequences, 300 steps, cosine decay
EMBEDDED_JOB = (("--num-layers", "4"), ("--hidden-size", "128"), ("--num-attention-heads", "4"),
                ("--seq-length", "128"), ("--max-position-embeddings", "128"), ("--normalization", "RMSNorm"),
                ("--swiglu",), ("--disable-bias-linear",), ("--position-embedding-type", "rope"),
                ("--micro-batch-size", "8"), ("--global-batch-size", "16"), ("--train-iters", "300"),
                ("--lr", "2e-3"), ("--min-lr", "2e-4"), ("--lr-decay-style", "cosine"), ("--lr-warmup-fraction", "0.1"),
                ("--weight-decay", "0.1"), ("--clip-grad", "1.0"), ("--log-interval", "10"),
                ("--eval-interval", "100"), ("--eval-iters", "8"))


# a default left out where the command line says the same another way
SAID_OTHERWISE = {"--lr-warmup-fraction": ("--lr-warmup-iters", "--lr-warmup-samples"),
                  "--train-iters": ("--train-samples",), "--lr-decay-style": ("--lr-wsd-decay-style",)}


# how long the job's other ranks, refusing the flags rank 0 refuses, wait before they exit: the first rank to
# exit has torch's agent stop the rest, and a silent one first (rank 1 or 2 at PP 3) left no reason printed
OTHER_RANKS_WAIT_S = 10.0


def refuse(problems: list) -> None:
    """Flags every rank refuses alike: rank 0 says why, once; each rank exits 2 (a usage error)."""
    if speaks_for_the_job():
        print("\n".join(f"megatron-siamese train: {problem}" for problem in problems), file=sys.stderr, flush=True)
    exit_refused()


def exit_refused() -> None:
    """Exit 2, after rank 0 where this is another rank (it says why, and its exit stops this one)."""
    if not speaks_for_the_job():
        time.sleep(OTHER_RANKS_WAIT_S)
    raise SystemExit(2)


def add_defaults(argv: list, gpu: bool) -> list:
    """``argv`` with what the command line leaves out: the CPU's flags off a GPU, the embedded
    default job without a model, the embedded corpus without a data source. Said once, by rank 0."""
    given = {word.split("=", 1)[0] for word in argv}  # --flag value and --flag=value
    cpu = [] if gpu else [word for flag in CPU_FLAGS if flag[0] not in given for word in flag]
    asks_help = bool(given & {"--help", "-h"})
    model = given & {"--num-layers", "--use-checkpoint-args"}  # a model given, or the checkpoint's asked for
    job = [] if model or asks_help else [
        word for flag in EMBEDDED_JOB if not given & {flag[0], *SAID_OTHERWISE.get(flag[0], ())} for word in flag]
    data = [] if given & set(DATA_SOURCE_FLAGS) or asks_help else embedded_data_flags(argv, given)
    # else Megatron-LM tries it, fails and points at an NVIDIA-internal page to install it
    one_logger = [] if any(flag.startswith(("--one-logger", "--no-one-logger")) for flag in given) or \
        importlib.util.find_spec("one_logger") else ["--no-one-logger"]
    if speaks_for_the_job():
        if cpu:
            print("megatron-siamese train: no GPU, so on CPU with " + " ".join(cpu), flush=True)
        if job:
            print("megatron-siamese train: no model given (--num-layers), so the embedded default: "
                  + " ".join(job), flush=True)
        elif model and not asks_help:
            print(f"megatron-siamese train: {sorted(model)[-1]} given, so nothing of the embedded default job: what the "
                  "command line leaves out is Megatron-LM's default", flush=True)
        if data:
            print("megatron-siamese train: no data source given, so the embedded corpus: "
                  + " ".join(data), flush=True)
        if one_logger:
            print("megatron-siamese train: one_logger (NVIDIA's internal metrics package) is not installed, so "
                  "--no-one-logger", flush=True)
    return argv + cpu + job + data + one_logger
