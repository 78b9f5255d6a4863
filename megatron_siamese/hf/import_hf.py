"""``megatron-siamese import-hf``: a Hugging Face model directory back as a checkpoint.

config.json is read as this package's model settings (``architecture.settings_fields``: a field
the trainer cannot build exactly is refused naming it), the tokenizer must give ByteTokenizer's
ids, the weights are renamed back (``convert.hf_to_megatron``), loaded strictly into a one-rank
GPTModel and saved as a model-only torch_dist checkpoint (step 0, no optimizer, as ``upcycle``
writes): ``megatron-siamese train --load OUT/checkpoints`` fine-tunes it at any layout
(torch_dist reshards on load, so no layout needs choosing when writing). Written into a
temporary directory beside the target and renamed at the end, like the export.
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

from megatron_siamese.hf import architecture, convert
from megatron_siamese.hf.architecture import ExportError
from megatron_siamese.hf.export import VERIFY_TEXT, WEIGHTS, refuse_existing, require_packages, written_atomically


def read_hf_config(directory: str) -> Dict[str, object]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ExportError(f"--hf {directory} has no config.json: give a Hugging Face model directory")
    with open(path) as source:
        return json.load(source)


def read_hf_weights(directory: str) -> Dict[str, torch.Tensor]:
    """model.safetensors, or the shards its index names."""
    from safetensors.torch import load_file

    single = os.path.join(directory, WEIGHTS)
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(directory, WEIGHTS + ".index.json")
    if not os.path.isfile(index):
        raise ExportError(f"--hf {directory} has no {WEIGHTS} (nor its index): safetensors weights are needed")
    with open(index) as source:
        shards = sorted(set(json.load(source)["weight_map"].values()))
    state: Dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(os.path.join(directory, shard)))
    return state


def check_tokenizer(directory: str) -> None:
    """ExportError unless ``directory``'s tokenizer gives ByteTokenizer's ids (the checkpoint was
    trained on those: UTF-8 bytes 0-255, end of document 256)."""
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise ExportError(f"--hf {directory} has no tokenizer.json: the byte-level tokenizer's files are needed "
                          "(export writes them)")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    probe = VERIFY_TEXT + " naïve"
    if (tokenizer(probe, add_special_tokens=False)["input_ids"] != list(probe.encode("utf-8"))
            or tokenizer.eos_token_id != 256):
        raise ExportError(f"--hf {directory}'s tokenizer is not the byte-level one (UTF-8 bytes as ids 0-255, end of "
                          "document 256): the model would read other ids than it was trained on")


def import_args(hf: Dict[str, object], output_dir: str):
    """TrainArgs of the model ``hf`` describes, on one rank (as the checkpoint records them)."""
    from megatron_siamese.training.args import TrainArgs, padded_vocab_size

    fields = architecture.settings_fields(hf, padded_vocab_size())
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"))
    if dtype is None:
        raise ExportError(f"torch_dtype {hf.get('torch_dtype')!r}: import float32 or bfloat16 weights")
    return TrainArgs(**fields, dtype=dtype, tp=1, pp=1, dp=1, fused_ops=False, output_dir=output_dir,
                     progress=False)


def import_hf(hf_dir: str, output_dir: str) -> str:
    """Write ``output_dir/checkpoints/iter_0000000`` (model only) from the Hugging Face directory
    ``hf_dir``; returns the checkpoint's path."""
    from megatron_siamese.runtime.launch import run_job

    require_packages()
    refuse_existing(output_dir)
    hf = read_hf_config(hf_dir)
    args = import_args(hf, output_dir)
    check_tokenizer(hf_dir)
    with written_atomically(output_dir) as tmp:
        path = run_job(_import_rank, 1, args, hf, hf_dir, tmp, needs="import-hf")
    return os.path.join(output_dir, os.path.relpath(path, tmp))


def _import_rank(args, hf: Dict[str, object], hf_dir: str, directory: str) -> str:
    from types import SimpleNamespace

    from megatron_siamese import device
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import initialize_model_parallel, transformer_config
    from megatron_siamese.training import checkpoint
    from megatron_siamese.training.args import padded_vocab_size

    state = convert.hf_to_megatron(read_hf_weights(hf_dir), hf, pre_norm=hf["model_type"] == "llama")
    initialize_model_parallel(args.layout, args.seed)
    try:
        (model,) = build_model_chunks(transformer_config(args, args.layout), args, padded_vocab_size())
        expected = {name for name in model.state_dict() if not name.endswith("_extra_state")}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ExportError(f"--hf {hf_dir} does not hold this model's weights: "
                              + (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"))
        model.load_state_dict(state, strict=False)  # strict but for Megatron's _extra_state entries
        model.to(device.current())
        written = SimpleNamespace(args=args, step=0, vocab_size=padded_vocab_size(), saved_before=False,
                                  model=[SimpleNamespace(module=model)])
        return checkpoint.save(written, os.path.join(directory, "checkpoints"), model_only=True)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
