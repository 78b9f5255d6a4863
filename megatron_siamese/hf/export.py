"""``megatron-siamese export``: a checkpoint as a Hugging Face model directory (the way back:
``import_hf.py``).

Export: the checkpoint's whole model on one rank (``inference.session``: any TP/PP/VPP layout,
resharded by dist_checkpointing on load), its config.json (``architecture.py``), its weights
renamed (``convert.py``) into ``model.safetensors``, the modeling file (SiameseNorm) and the
byte-level tokenizer's files (``tokenizer.py``). Before anything is kept, the exported model's
logits on a fixed text are compared with the Megatron model's (fp32: 1e-4 relative) and the
export refuses on a mismatch. Everything is written into a temporary directory beside the
target, renamed into place at the end: nothing is ever left half-written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import torch

from megatron_siamese.hf import architecture, convert
from megatron_siamese.hf.architecture import ExportError

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
    """A fresh directory beside ``output_dir``, renamed to it when the block succeeds, removed when not."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.", suffix=".partial", dir=parent)
    try:
        yield tmp
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
    if settings.num_moe_experts:
        return "--num-experts (mixture of experts) has no export yet: export a dense model"
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
        verify(model, directory)
        provenance = dict(checkpoint=os.path.abspath(session.checkpoint), step=session.step,
                          settings=dataclasses.asdict(session.settings))
        with open(os.path.join(directory, PROVENANCE), "w") as out:
            json.dump(provenance, out, indent=2)
    finally:
        session.close()


def hf_config(model, norm: str) -> Dict[str, object]:
    """config.json for a one-rank GPTModel of scheme ``norm``."""
    variant = SCHEMES[norm]
    return architecture.llama_config(model) if variant is None else architecture.siamese_config(model, variant)


def write_directory(model, norm: str, directory: str) -> Dict[str, object]:
    """config.json, model.safetensors, the modeling file (SiameseNorm) and the tokenizer of the
    one-rank GPTModel ``model`` (scheme ``norm``) into ``directory``; returns the config."""
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
    """The model in an exported ``directory`` (AutoModelForCausalLM, local files, remote code), eval
    mode. In a process running Megatron through the CPU shim (a spawned rank, the tests) the shim
    is lifted meanwhile (``cpu_shim.lifted``: transformers' loading does not survive it)."""
    from transformers import AutoModelForCausalLM

    from megatron_siamese.runtime import cpu_shim

    with cpu_shim.lifted():
        return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True).eval()


def verify(model, directory: str) -> float:
    """The exported model's logits against the Megatron model's on ``VERIFY_TEXT``, relative to
    their largest magnitude; ExportError above ``VERIFY_RTOL`` (fp32) or ``VERIFY_RTOL_16BIT``
    (bf16 weights, run as the trainer runs them, in Megatron's Float16Module: rounding alone
    reaches about 2e-2 there, a misplaced weight gives errors of order 1)."""
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
    with torch.no_grad():
        expected = megatron(tokens.to(device), positions.to(device), causal.to(device)).float().cpu()
        actual = load_exported(directory)(tokens).logits.float()
    error = float((actual - expected).abs().max() / expected.abs().max())
    if not error <= tolerance:
        raise ExportError(f"the exported model's logits differ from the checkpoint's by {error:.2e} of their "
                          f"magnitude (allowed {tolerance:.0e}): please report this model's settings")
    return error
