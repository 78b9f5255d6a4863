"""Megatron's own training loop with the SiameseNorm layer: ``megatron.training.pretrain`` and
Megatron-LM's flags, our model provider, forward step and dataset provider (megatron-core >= 0.17).

    torchrun --nproc-per-node 2 -m megatron_siamese.runtime.pretrain --tensor-model-parallel-size 2 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 512 --train-iters 10 --lr 1e-3 --log-interval 1

Every flag is Megatron-LM's. Without ``--mock-data`` or ``--data-path`` it trains on the embedded
corpus; without a GPU it runs on gloo through the CPU shim. docs/training.md, docs/megatron-lm.md.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from functools import partial
from typing import Optional

# read by torch at import: before anything imports it (as runtime/megatron_lm.py does)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402

from megatron_siamese import device  # noqa: E402
from megatron_siamese.runtime import pretrain_load as load  # noqa: E402
from megatron_siamese.runtime.pretrain_flags import add_defaults, exit_refused, refuse  # noqa: E402
from megatron_siamese.runtime.pretrain_refusals import accepted_args  # noqa: E402
from megatron_siamese.runtime.registry import typos  # noqa: E402
from megatron_siamese.versions import speaks_for_the_job  # noqa: E402

def require_megatron_training() -> None:
    from megatron_siamese.versions import training_loop_problem

    problem = training_loop_problem("megatron_siamese.runtime.pretrain")
    if problem:
        raise SystemExit(problem)


# our flags beside Megatron-LM's (its extra_args_provider), each defined once in runtime/settings.py:
# the residual scheme and SiameseNorm's options, stored under their TransformerConfig names (the
# checkpoint's args keep them, so export and generate rebuild the same model)
SIAMESE_SETTINGS = ("norm", "siamese_input_norm", "siamese_depth_scale", "mix_ln_alpha", "hybridnorm_star",
                    "fused_ops", "boundary_ops")
SIAMESE_GROUP = "SiameseNorm (megatron_siamese)"


def add_siamese_arguments(parser):
    from megatron_siamese.runtime.registry import add_setting, definitions
    from megatron_siamese.runtime.settings import ModelSettings

    group = parser.add_argument_group(SIAMESE_GROUP)
    for name in SIAMESE_SETTINGS:
        definition = definitions(ModelSettings)[name]
        add_setting(group, definition, dest=definition.config or name)
    return parser


USAGE = "megatron-siamese train [--nproc-per-node N] [--norm SCHEME] [Megatron-LM's flags]"


# our own loop's flags (megatron-core 0.16.1) that Megatron-LM names otherwise (docs/training.md's table)
OUR_LOOP_FLAGS = {"--tp": "--tensor-model-parallel-size", "--pp": "--pipeline-model-parallel-size",
                  "--vpp": "--num-virtual-stages-per-pipeline-rank", "--cp": "--context-parallel-size",
                  "--ep": "--expert-model-parallel-size", "--etp": "--expert-tensor-parallel-size",
                  "--sp": "--sequence-parallel", "--dp": "--nproc-per-node (DP is the ranks over TP x PP x CP)",
                  "--steps": "--train-iters", "--warmup-steps": "--lr-warmup-iters", "--data-prefix": "--data-path",
                  "--output-dir": "--save DIR/checkpoints --tensorboard-dir DIR/tensorboard",
                  "--cache-dir": "the environment variable MEGATRON_SIAMESE_CACHE", "--stop-step": "--exit-interval",
                  "--dtype": "--bf16", "--fp8": "--fp8-format", "--model": "--hybrid-layer-pattern",
                  "--recompute": "--recompute-granularity"}


def megatron_parser(usage: str = USAGE):
    """Megatron-LM's argument parser as its parse_args builds it, with our group; a flag of our own
    loop's is named with Megatron-LM's for it. ``usage``: the command whose flags these are."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            if not speaks_for_the_job():  # every rank refuses the same flags; rank 0 says so
                exit_refused()
            if message.startswith("unrecognized arguments:"):
                flags = [word.split("=", 1)[0] for word in message.split(":", 1)[1].split() if word.startswith("-")]
                renamed = [f"{flag} is {OUR_LOOP_FLAGS[flag]}" for flag in flags if flag in OUR_LOOP_FLAGS]
                message += f" (in Megatron-LM's flags: {'; '.join(renamed)})" if renamed else ""
                message += typos([flag for flag in flags if flag not in OUR_LOOP_FLAGS], self._option_string_actions)
            super().error(message)

    return add_siamese_arguments(add_megatron_arguments(
        Parser(prog=" ".join(usage.split()[:2]), usage=usage, description="Megatron-LM Arguments", allow_abbrev=False)))


def print_help() -> None:
    """Megatron-LM's flags, ours among them. A help text with a bare '%' (megatron-core 0.19.2 has
    one) is printed as written instead of failing."""
    import re

    parser = megatron_parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        try:
            formatter._expand_help(action)
        except (TypeError, ValueError, KeyError):
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    parser.print_help()


def siamese_config(config, args):
    """``config`` (Megatron-LM's, from its flags) as our config class, with SiameseNorm's options
    from our flags and what the scheme needs (HybridNorm's QK-norm, say)."""
    import dataclasses

    from megatron_siamese.config import SiameseOptions, siamese_config_class
    from megatron_siamese.models import scheme

    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
    options = {field.name: getattr(args, field.name) for field in dataclasses.fields(SiameseOptions)}
    return siamese_config_class(args.multi_latent_attention)(**{**values, **options, **scheme(args.norm).config})


def layer_spec(args, config, vp_stage=None):
    """``--spec MODULE NAME`` as Megatron-LM reads it, else ours for the model and ``--norm``: a
    HybridModel's stack spec, or the scheme's block spec for this (virtual) pipeline stage."""
    if args.spec:
        module, name = args.spec
        return getattr(importlib.import_module(module), name)
    if args.hybrid_layer_pattern:
        from megatron_siamese import hybrid

        te = args.transformer_impl == "transformer_engine"
        return hybrid.siamese_hybrid_te_stack_spec if te else hybrid.siamese_hybrid_stack_spec
    from megatron_siamese.models import scheme

    return scheme(args.norm).block_spec(config, vp_stage)


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, vp_stage=None):
    """What ``pretrain()``'s ``get_model`` calls: a GPTModel of SiameseNorm layers (with MTP where
    asked), or a HybridModel with ``--hybrid-layer-pattern``, built as Megatron-LM's GPT builder does."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_siamese.runtime.quiet import silence_known_notices

    silence_known_notices(on_cpu_shim=not device.uses_cuda())  # again: Megatron-LM has set up its logging now
    args = get_args()
    config = siamese_config(config or core_transformer_config_from_args(args), args)
    spec = layer_spec(args, config, vp_stage)
    common = dict(vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                  pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                  parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                  position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                  rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage)
    if args.hybrid_layer_pattern:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        return HybridModel(config=config, hybrid_stack_spec=spec, hybrid_layer_pattern=args.hybrid_layer_pattern,
                           seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, **common)
    from megatron_siamese.models import gpt_model

    return gpt_model(config, spec, rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                     seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, **common)


SPIKY_LOSS_FACTOR = 10  # Megatron-LM's: a loss ten times the largest seen so far is a spike


def loss_func(loss_mask, output_tensor):
    """Megatron's (summed loss, tokens, logged values) contract, with Megatron-LM's NaN/Inf and spiky-loss
    checks through its rerun state machine."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().detach().to(torch.int)
    args, rerun = get_args(), get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejected, name in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            # a forward pass is deterministic: a rerun must reproduce the loss exactly
            rerun.validate_result(result=loss, rejection_func=rejected, tolerance=0.0, fatal=True,
                                  message=f"found {name} in local forward loss calculation")
    if args.check_for_spiky_loss:
        spiky = partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
        rerun.validate_result(result=loss, rejection_func=spiky, message="Spiky loss", tolerance=0.0, fatal=False)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    """Each rank of a stage that needs the batch reads it itself (no tensor-parallel broadcast); a
    context-parallel rank keeps its two chunks of each sequence."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
    from megatron.training.utils.common_utils import is_first_or_last_pipeline_stage

    vp_stage = get_attr_wrapped_model(model, "vp_stage")  # through DDP, which does not forward it
    if not is_first_or_last_pipeline_stage(vp_stage):
        return model(None, None, None), partial(loss_func, None)
    batch = {key: (value.cuda() if value is not None else None) for key, value in next(data_iterator).items()}
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    say_the_stream_arithmetic(model, output.device)
    return output, partial(loss_func, batch["loss_mask"])


_arithmetic_said = False


def say_the_stream_arithmetic(model, device) -> None:
    """Rank 0, after its first forward: whether SiameseNorm's fused ops ran, or why not."""
    global _arithmetic_said
    if _arithmetic_said or torch.distributed.get_rank() != 0:
        return
    _arithmetic_said = True
    chosen = next((module.stream_arithmetic for module in model.modules() if hasattr(module, "stream_arithmetic")), None)
    if chosen is not None:  # a single-stream scheme has none
        print(f"megatron-siamese train: the streams' norms and residuals on {device.type}: {chosen.describe(device)}",
              flush=True)


# GPTDatasetConfig's fields that Megatron-LM's pretrain_gpt.py fills from its flags, beside those
# datasets_provider names; each from the argument of its own name but where RENAMED says otherwise
DATASET_FIELDS = ("multiple_validation_sets", "full_validation", "num_dataset_builder_threads", "mmap_bin_files",
                  "object_storage_cache_path", "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens",
                  "fast_cache_load", "defer_npy_index_mmap")
RENAMED = {"fast_cache_load": "dataloader_fast_cache_load", "defer_npy_index_mmap": "dataloader_defer_npy_index_mmap"}


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (mock, or the indexed ones of ``--data-path`` and its kin) from the
    flags Megatron-LM's own script reads, those this megatron-core's GPTDatasetConfig has."""
    import dataclasses

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    fields = {field.name for field in dataclasses.fields(GPTDatasetConfig)}
    arguments = {name: RENAMED.get(name, name) for name in DATASET_FIELDS if name in fields}
    more = {name: getattr(args, argument) for name, argument in arguments.items() if hasattr(args, argument)}
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                              blend_per_split=blend_per_split, split=args.split, path_to_cache=args.data_cache_path,
                              tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
                              create_attention_mask=args.create_attention_mask_in_dataloader, **more)
    dataset = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # every rank builds its own (pretrain_gpt.py's flag)


def held_back_exit_signal() -> Optional[int]:
    """The signal Megatron's --exit-signal-handler noted, if it did (its loop then saved and returned),
    with the handler taken off: the process is to end on it. Read from Megatron's handler itself (its
    getter asserts that one was set, and its own check is a collective)."""
    try:
        from megatron.training import global_vars
    except ImportError:  # refused by version: nothing ran
        return None
    handler = getattr(global_vars, "_GLOBAL_SIGNAL_HANDLER", None)
    if handler is None or not getattr(handler, "_signal_received", False):
        return None
    handler.release()
    return handler.sig


def draw_the_loss_curve(args) -> None:
    """On the rank writing Megatron's TensorBoard events (the last), the run's loss curve beside them.
    A curve that cannot be drawn is a warning: the run's outcome stands."""
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is None:
        return
    try:
        writer.flush()
        from megatron_siamese.runtime.loss_curve import plot_run

        path, train, validation = plot_run(args.tensorboard_dir,
                                           title=f"SiameseNorm, {args.num_layers} layers, h {args.hidden_size}")
    except Exception as error:  # noqa: BLE001 - the curve is a report, not the run
        print(f"megatron-siamese train: warning: no loss curve ({type(error).__name__}: {error})",
              flush=True)
        return
    latest = [_last_logged_loss(train, args.log_interval)] if train else []
    latest += [f"validation {validation[max(validation)]:.4f}"] if validation else []
    print(f"megatron-siamese train: loss curve {path}" + (f" ({', '.join(latest)})" if latest else ""),
          flush=True)


def _last_logged_loss(train: dict, log_interval: int) -> str:
    from megatron_siamese.runtime.loss_curve import last_logged

    iterations, mean = last_logged(train, log_interval)
    return (f"iterations {iterations}: mean lm loss {mean:.4f}" if "-" in iterations else
            f"iteration {iterations}: lm loss {mean:.4f}")


def main() -> None:
    from megatron_siamese.runtime.quiet import silence_known_notices

    silence_known_notices()  # Megatron's notices of a machine without apex or TE, torch's of no CUDA
    require_megatron_training()
    gpu = device.uses_cuda()
    if not gpu:
        from megatron_siamese.runtime.megatron_lm import serve_megatron_training_on_cpu

        serve_megatron_training_on_cpu()
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    sys.argv = add_defaults(sys.argv, gpu)
    megatron_parser().parse_args(sys.argv[1:])  # a usage error said with a usage line, not Megatron's 500
    args = accepted_args(add_siamese_arguments, siamese_config)
    if load.loads_weights_only(args):
        args.no_load_optim = True
        if speaks_for_the_job():
            print(f"megatron-siamese train: --load {args.load} holds model weights only (upcycle, import-hf), so "
                  "--no-load-optim: a fresh optimizer from its weights", flush=True)
    if args.save:  # Megatron's writer would fork a results-queue manager that outlives a killed rank
        from megatron_siamese.runtime.orphans import checkpoint_writer_dies_with_its_rank

        checkpoint_writer_dies_with_its_rank("fork")  # no process group yet
    try:
        pretrain(pretrain_cfg_container_from_args(args, None), datasets_provider, ModelType.encoder_or_decoder,
                 forward_step, model_provider=model_provider, store=load.restart_store(args))
    except SystemExit as stop:  # Megatron's exits: --exit-interval, --exit-duration-in-mins, a signal, a rerun
        if stop.code in (None, 0):  # saved and stopped as asked (a rerun's codes ask for a resume: no curve)
            draw_the_loss_curve(args)
        raise
    except (AssertionError, ValueError) as failed:  # its load's checks of the optimizer against the flags
        refuse([resume_problem(failed, args.load)])
    draw_the_loss_curve(args)


def resume_problem(failed: Exception, load: str) -> str:
    """What to change, for Megatron's load refusing these flags' optimizer or schedule (a bare assert, or a
    ValueError of many lines); any other failure is raised again."""
    said = str(failed)
    if isinstance(failed, AssertionError) and said.startswith("OptimizerParamScheduler:"):  # a longer --train-iters
        # Megatron's words: "class input value 80.0 and checkpointvalue 48.0 for warmup iterations do not match"
        found = re.search(r"class input value (\S+) and checkpoint ?value (\S+) for (.+?) do not match", said)
        what = (f"{found[3]}, which Megatron's scheduler counts in samples (iterations x global batch): {found[1]} "
                f"from these flags, {found[2]} in the checkpoint" if found else said.split(": ", 1)[1])
        return (f"--load {load} was saved with another learning-rate schedule than these flags give ({what}): give "
                "the flags it was saved with, or add --override-opt_param-scheduler (these flags' schedule from here "
                "on) or --use-checkpoint-opt_param-scheduler (the checkpoint's)")
    if load and isinstance(failed, AssertionError) and said.startswith("no samples left to consume"):  # data position
        return (f"--load {load}: its data position is past the datasets these flags make (Megatron's sampler: "
                f"{said}): another --eval-interval, --eval-iters or --global-batch-size than it was saved with "
                "changes their size; give those it was saved with")
    if isinstance(failed, ValueError) and said.startswith("Could not find parameter group with key"):  # another --lr
        return (f"--load {load}: its optimizer was saved with another --lr, --min-lr or weight decay than these "
                "flags give (Megatron's parameter groups are keyed by them): give those it was saved with, or "
                "--no-load-optim (a fresh optimizer from its weights)")
    raise failed


if __name__ == "__main__":
    sys.exit(main())
