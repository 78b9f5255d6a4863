"""``megatron-siamese export`` and ``import-hf``: to Hugging Face Transformers and back (docs/export.md)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from megatron_siamese.cli import flags
from megatron_siamese.training.args import ConfigError

EXPORT_DESCRIPTION = """\
Write a Hugging Face Transformers model directory from a checkpoint saved at any TP/PP/VPP
layout: config.json (auto_map), model.safetensors, the self-contained modeling file
(SiameseNorm; a Pre-Norm model exports as transformers' LlamaForCausalLM), the byte-level
tokenizer. Load it with AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).
The export compares the exported model's logits with the checkpoint's before keeping anything.
Needs transformers and safetensors: pip install 'megatron_siamese[hf]'.
"""

IMPORT_DESCRIPTION = """\
Write a Megatron torch_dist checkpoint (model only, step 0, as upcycle writes) from a Hugging Face
directory that `export` wrote (or any SiameseNormForCausalLM / matching LlamaForCausalLM):
OUTPUT_DIR/checkpoints, which `megatron-siamese train --load OUTPUT_DIR/checkpoints` fine-tunes at
any layout (torch_dist reshards on load). Needs transformers and safetensors.
"""


def _refused(error: Exception) -> ConfigError:
    return ConfigError([str(error).strip().splitlines()[0]])


def _export_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="a checkpoint as a Hugging Face Transformers model directory",
                                 description=EXPORT_DESCRIPTION, formatter_class=flags.HelpFormatter)
    parser.add_argument("--load", required=True, metavar="CHECKPOINT",
                        help="a run's directory (scripts/run.sh's runs/<time>), its checkpoints directory or one iter_<N> in it "
                             "(any TP/PP/VPP layout)")
    parser.add_argument("--output-dir", required=True, help="the new model directory (must not exist)")
    return parser


def _run_export(options: argparse.Namespace) -> int:
    from megatron_siamese.hf.export import ExportError, export, summary
    from megatron_siamese.training.checkpoint_files import CheckpointError

    try:
        path = export(options.load, options.output_dir)
    except (ExportError, CheckpointError) as error:
        raise _refused(error) from None
    print(summary(path))
    return 0


def _import_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help="a Hugging Face model directory as a Megatron checkpoint",
                                 description=IMPORT_DESCRIPTION, formatter_class=flags.HelpFormatter)
    parser.add_argument("--hf", required=True, metavar="DIR", help="the Hugging Face model directory")
    parser.add_argument("--output-dir", required=True,
                        help="the new directory (must not exist); the checkpoint goes to OUTPUT_DIR/checkpoints")
    return parser


def _run_import(options: argparse.Namespace) -> int:
    from megatron_siamese.hf.export import ExportError, import_hf

    try:
        path = import_hf(options.hf, options.output_dir)
    except ExportError as error:
        raise _refused(error) from None
    print(f"Megatron checkpoint (step 0, model only): {path}")
    return 0


export = SimpleNamespace(add_parser=_export_parser, run=_run_export)
import_hf = SimpleNamespace(add_parser=_import_parser, run=_run_import)
