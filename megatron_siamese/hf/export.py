"""``megatron-siamese export`` and ``import-hf``: a checkpoint as a Hugging Face model directory,
and such a directory back as a (model-only, step 0) checkpoint.

Export verifies the written model's logits against the Megatron model's before keeping anything, and both
commands write into a temporary directory renamed into place at the end: nothing is left half-written.
Full story: docs/export.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch

from megatron_siamese.hf import architecture, convert
from megatron_siamese.hf.architecture import ExportError
from megatron_siamese.hf.tokenizer import PAD_ID
from megatron_siamese.training.checkpoint_files import is_checkpoint

PACKAGES = ("transformers", "safetensors")
INSTALL = "pip install 'megatron_siamese[hf]' (transformers, safetensors)"
WEIGHTS = "model.safetensors"
PROVENANCE = "megatron_siamese.json"  # which checkpoint and settings the directory came from
VERIFY_TEXT = "In the beginning God created the heaven and the earth.\n"
VERIFY_RTOL = 1e-4
VERIFY_RTOL_16BIT = 5e-2
SCHEMES = {"siamese": "standard", "siamese-layer": "standard", "siamese-hybrid": "hybrid", "pre": None}


def require_packages() -> None:
    """ExportError naming what to install when transformers or safetensors is missing."""
    import importlib.util

    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"{' and '.join(missing)} not installed: {INSTALL}")


def refuse_existing(output_dir: str) -> None:
    if os.path.lexists(output_dir):
        raise ExportError(f"--output-dir {output_dir} exists: choose a new directory (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(output_dir))
    if not os.path.isdir(parent):
        raise ExportError(f"--output-dir {output_dir}: its parent directory {parent} does not exist")


@contextmanager
def written_atomically(output_dir: str) -> Iterator[str]:
    """A fresh directory beside ``output_dir``, renamed to it when the block succeeds, removed when not.
    Its files get the umask's permissions: mkdtemp's 0700 and safetensors' 0600 would hide them on a cluster."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.", suffix=".partial", dir=parent)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for directory, _, files in os.walk(tmp):
            os.chmod(directory, 0o777 & ~umask)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o666 & ~umask)
        os.rename(tmp, output_dir)  # fails, rather than merges, if the target appeared meanwhile
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def exportable(settings) -> Optional[str]:
    """Why a checkpoint of ``settings`` (runtime.settings.ModelSettings) cannot be exported, or None."""
    if settings.model == "hybrid":
        from megatron_siamese.hybrid_pattern import GPT_BLOCK, hybrid_pattern

        layers = hybrid_pattern(settings).layers
        if layers != GPT_BLOCK * (len(layers) // 2) or hybrid_pattern(settings).mtp is not None:
            return (f"a HybridModel with the pattern {hybrid_pattern(settings).text!r} has no export yet: only "
                    "'*-*-...' (the GPT's equivalent) exports")
    elif settings.model != "gpt":
        return f"a {settings.model} model has no export"
    if settings.norm not in SCHEMES:
        return (f"the {settings.norm!r} scheme has no export (siamese, siamese-layer, siamese-hybrid, or pre as "
                "Llama)")
    unwritten = [problem for present, problem in (  # every one at once: a DeepSeek-shaped model has all three
        (settings.num_moe_experts, "--num-experts (mixture of experts) has no export yet: export a dense model"),
        (settings.multi_latent_attention, architecture.MLA_REFUSED),
        (settings.mtp_num_layers, architecture.MTP_REFUSED)) if present]
    if unwritten:
        return "; ".join(unwritten)
    if not (getattr(settings, "siamese_input_norm", True) and getattr(settings, "siamese_depth_scale", True)):
        return ("the component study's ablations (--no-siamese-input-norm, --no-siamese-depth-scale) have no export: "
                "the exported modeling file computes the full SiameseNorm block")
    return None


# -- export --------------------------------------------------------------------------------


def export(checkpoint: str, output_dir: str, settings=None) -> str:
    """Write the Hugging Face directory of ``checkpoint`` to ``output_dir`` (new); returns its path.
    ``settings``: the model's, for a checkpoint that records none (Megatron-LM's)."""
    from megatron_siamese.inference.session import model_settings, read_checkpoint
    from megatron_siamese.runtime.launch import run_job

    require_packages()
    refuse_existing(output_dir)
    chosen = model_settings(read_checkpoint(checkpoint), settings)
    problem = exportable(chosen)
    if problem:
        raise ExportError(f"cannot export {checkpoint}: {problem}")
    with written_atomically(output_dir) as tmp:
        run_job(_export_rank, 1, checkpoint, settings, tmp, needs="export")
    return output_dir


def _export_rank(checkpoint: str, settings, directory: str) -> None:
    from megatron_siamese.inference.session import open_session

    session = open_session(checkpoint, settings=settings, fused_ops=False)
    try:
        model = session.chunks[0]
        write_directory(model, session.settings.norm, directory)
        difference = verify(model, directory)
        provenance = dict(checkpoint=os.path.abspath(session.checkpoint), step=session.step,
                          settings=dataclasses.asdict(session.settings), logits_difference=difference)
        with open(os.path.join(directory, PROVENANCE), "w") as out:
            json.dump(provenance, out, indent=2)
    finally:
        session.close()


def summary(directory: str) -> str:
    """What an export wrote into ``directory``, from its provenance and config: the lines the command prints."""
    with open(os.path.join(directory, PROVENANCE)) as source:
        provenance = json.load(source)
    settings, config = provenance["settings"], read_hf_config(directory)
    return (f"exported iteration {provenance['step']} of {provenance['checkpoint']}: --norm {settings['norm']}, "
            f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {PAD_ID + 1} byte-level tokens in "
            f"{config['vocab_size']} embedding rows, "
            f"{config['architectures'][0]}; its logits are the checkpoint's to "
            f"{provenance['logits_difference']:.1e} of their magnitude\n"
            f"Hugging Face model: {directory} (AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))")


def hf_config(model, norm: str) -> Dict[str, object]:
    """config.json for a one-rank GPTModel of scheme ``norm``."""
    variant = SCHEMES[norm]
    return architecture.llama_config(model) if variant is None else architecture.siamese_config(model, variant)


def write_directory(model, norm: str, directory: str) -> Dict[str, object]:
    """The Hugging Face files of the one-rank GPTModel ``model`` into ``directory``; returns the config."""
    from safetensors.torch import save_file

    from megatron_siamese.hf.tokenizer import save_tokenizer

    config = hf_config(model, norm)
    config["torch_dtype"] = str(model.config.params_dtype).replace("torch.", "")
    pre_norm = config["model_type"] == "llama"
    state = model.state_dict()
    if hasattr(model.decoder, "final_norm"):  # a '*-*-...' HybridModel: the GPT it equals
        config["num_hidden_layers"] = model.config.num_layers // 2
        state = convert.hybrid_to_gpt_names(state)
    state = convert.megatron_to_hf(state, config, pre_norm=pre_norm)
    save_file({name: tensor.detach().cpu() for name, tensor in state.items()}, os.path.join(directory, WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out, indent=2, sort_keys=True)
    with open(os.path.join(directory, "generation_config.json"), "w") as out:
        json.dump({k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, out, indent=2)
    if not pre_norm:
        shutil.copyfile(os.path.join(os.path.dirname(__file__), architecture.MODELING_FILE),
                        os.path.join(directory, architecture.MODELING_FILE))
    save_tokenizer(directory)
    return config


def load_exported(directory: str):
    """The model in an exported ``directory`` (AutoModelForCausalLM, local files, remote code), eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a weight-loading bar in the middle of our own output
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True).eval()


def verify(model, directory: str) -> float:
    """The exported model's logits against the Megatron model's on ``VERIFY_TEXT``, relative to their largest
    magnitude; ExportError above the tolerance (bf16: rounding alone reaches 2e-2, a misplaced weight order 1)."""
    sixteen_bit = model.config.params_dtype != torch.float32
    tolerance = VERIFY_RTOL_16BIT if sixteen_bit else VERIFY_RTOL
    megatron = model
    if sixteen_bit:
        from megatron.core.transformer.module import Float16Module

        megatron = Float16Module(model.config, model)
    tokens = torch.tensor([list(VERIFY_TEXT.encode("utf-8"))[: model.max_sequence_length]])
    positions = torch.arange(tokens.shape[1])[None]
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)[None, None]
    device = next(model.parameters()).device
    exported = load_exported(directory)
    with torch.no_grad():
        expected = megatron(tokens.to(device), positions.to(device), causal.to(device)).float().cpu()
        actual = exported(tokens).logits.float()
    forget_remote_code(exported)
    error = float((actual - expected).abs().max() / expected.abs().max())
    if not error <= tolerance:
        raise ExportError(f"the exported model's logits differ from the checkpoint's by {error:.2e} of their "
                          f"magnitude (allowed {tolerance:.0e}): please report this model's settings")
    return error


def forget_remote_code(model) -> None:
    """Removes the copy of ``model``'s modeling file that Transformers made in its modules cache (as
    transformers_modules.<its directory's name>[.<hash>].modeling_siamese): one more for every export, under
    the temporary directory's name, kept for good. Nothing for a model of Transformers' own (a Pre-Norm
    export is a Llama)."""
    module = type(model).__module__
    if not module.startswith("transformers_modules."):
        return
    cached = sys.modules[module].__file__
    for _ in module.split(".")[2:]:
        cached = os.path.dirname(cached)
    shutil.rmtree(cached, ignore_errors=True)


# -- import --------------------------------------------------------------------------------


def read_hf_config(directory: str) -> Dict[str, object]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ExportError(f"--hf {directory} has no config.json: give a Hugging Face model directory" + (
            " (it is a checkpoint already: `megatron-siamese export` makes a Hugging Face model of it)"
            if is_checkpoint(directory) else ""))
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
    """ExportError unless ``directory``'s tokenizer gives ByteTokenizer's ids, which the checkpoint was trained on."""
    # the fast tokenizer's class itself: AutoTokenizer would read config.json and, for a remote-code
    # model, ask on the terminal whether to trust its code (a tokenizer needs none)
    from transformers import PreTrainedTokenizerFast

    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise ExportError(f"--hf {directory} has no tokenizer.json: the byte-level tokenizer's files are needed "
                          "(export writes them)")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    probe = VERIFY_TEXT + " naïve"
    if (tokenizer(probe, add_special_tokens=False)["input_ids"] != list(probe.encode("utf-8"))
            or tokenizer.eos_token_id != 256):
        raise ExportError(f"--hf {directory}'s tokenizer is not the byte-level one (UTF-8 bytes as ids 0-255, end of "
                          "document 256): the model would read other ids than it was trained on")


def import_args(hf: Dict[str, object], output_dir: str):
    """TrainArgs of the model ``hf`` describes, on one rank (as the checkpoint records them)."""
    from megatron_siamese.data.corpus import ByteTokenizer
    from megatron_siamese.training.args import TrainArgs

    fields = architecture.settings_fields(hf, ByteTokenizer().vocab_size)
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(str(hf.get("torch_dtype") or hf.get("dtype") or "float32"))
    if dtype is None:
        raise ExportError(f"torch_dtype {hf.get('torch_dtype')!r}: import float32 or bfloat16 weights")
    return TrainArgs(**fields, dtype=dtype, tp=1, pp=1, dp=1, fused_ops=False, output_dir=output_dir)


def import_hf(hf_dir: str, output_dir: str) -> str:
    """Write ``output_dir/checkpoints/iter_0000000`` (model only) from ``hf_dir``; returns its path."""
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
    from megatron_siamese import device
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import initialize_model_parallel, transformer_config
    from megatron_siamese.training import checkpoint

    state = convert.hf_to_megatron(read_hf_weights(hf_dir), hf, pre_norm=hf["model_type"] == "llama")
    initialize_model_parallel(args.layout, args.seed)
    try:
        # the vocabulary as the export holds it: the byte tokens, padded as the run that trained it padded them
        (model,) = build_model_chunks(transformer_config(args, args.layout), args, int(hf["vocab_size"]))
        expected = {name for name in model.state_dict() if not name.endswith("_extra_state")}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ExportError(f"--hf {hf_dir} does not hold this model's weights: "
                              + (f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"))
        model.load_state_dict(state, strict=False)  # strict but for Megatron's _extra_state entries
        model.to(device.current())
        return checkpoint.save_model([model], args, os.path.join(directory, "checkpoints"))
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
