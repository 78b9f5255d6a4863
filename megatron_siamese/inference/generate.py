"""Text generation from a checkpoint through Megatron-Core's own inference stack.

A SiameseNorm sublayer hands its attention the one normalized input both streams share, so one KV cache serves
both. The static engine (Megatron's "legacy" path) runs on CPU and GPU; the dynamic one needs a GPU with flash-attn
(``dynamic.py``). Generation runs without the MTP heads (0.16's GPTModel would run them and ask for labels).
Full story, and what is refused: docs/inference.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.data.corpus import ByteTokenizer


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (``top_k=1``, the default) or sampled."""

    temperature: float = 1.0
    top_k: int = 1  # 1: greedy; 0: no top-k cut
    top_p: float = 0.0  # 0: no nucleus cut
    seed: int = 1234

    def problems(self) -> List[str]:
        found = []
        if not self.temperature > 0:
            found.append(f"--temperature must be > 0 (got {self.temperature:g})")
        if self.top_k < 0:
            found.append(f"--top-k must be >= 0 (got {self.top_k})")
        if not 0.0 <= self.top_p <= 1.0:
            found.append(f"--top-p must lie in [0, 1] (got {self.top_p:g})")
        if self.top_k > 0 and self.top_p > 0.0:  # greedy is top-k 1
            found.append("Megatron's sampler takes --top-k or --top-p, not both: drop one (top-k 0 with top-p)")
        return found


@dataclass
class Generation:
    """One prompt's continuation."""

    prompt: str
    text: str  # the generated text only
    tokens: List[int] = field(default_factory=list)  # the generated token ids (EOD included if it came)


class InferenceTokenizer(ByteTokenizer):
    """The embedded corpus's byte tokenizer with what Megatron's text-generation controller reads."""

    bos = None  # no beginning-of-sequence token

    @property
    def eod(self) -> int:
        return self.EOD

    def detokenize(self, ids, **unused) -> str:
        return super().detokenize(ids)


def prompt_problems(prompts: Sequence[str], max_new_tokens: int, seq_length: int) -> List[str]:
    """What of the prompts and the length asked for the model cannot take (one line each)."""
    tokenizer = InferenceTokenizer()
    found = []
    if not prompts:
        found.append("give at least one --prompt")
    if max_new_tokens < 1:
        found.append(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    for i, prompt in enumerate(prompts):
        length = len(tokenizer.tokenize(prompt))
        if length == 0:
            found.append(f"prompt {i + 1} is empty")
        elif length + max(max_new_tokens, 0) > seq_length:
            found.append(f"prompt {i + 1} has {length} tokens; with --max-new-tokens {max_new_tokens} that is "
                         f"{length + max_new_tokens} positions, more than the {seq_length} the model was trained on "
                         f"(--seq-length): shorten the prompt or lower --max-new-tokens")
    return found


def _wrapper_class():
    """Megatron's GPTInferenceWrapper with pipeline receive buffers ``2h`` wide for the packed streams
    (``pipeline.py``)."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class SiameseGPTInferenceWrapper(GPTInferenceWrapper):
        def _allocate_recv_buffer(self, batch_size, seq_len):
            buffer = super()._allocate_recv_buffer(batch_size, seq_len)
            if buffer.shape[-1] != self.model.config.hidden_size or not self.packs_streams:
                return buffer
            return buffer.new_empty((*buffer.shape[:-1], 2 * buffer.shape[-1]))

    return SiameseGPTInferenceWrapper


ENGINES = ("static", "dynamic")
# Megatron's MLA asserts cache_mla_latents under the dynamic engine, and that latent cache runs
# FlashMLA's kernels with blocks of 64 tokens, which dynamic.py does not set up
MLA_DYNAMIC_REFUSED = ("--engine dynamic with multi-latent attention (--multi-latent-attention): Megatron's dynamic "
                       "engine attends over MLA only through its FlashMLA latent cache, which generate does not set "
                       "up; use --engine static")


def engine_problem(engine: str) -> Optional[str]:
    """Why ``engine`` cannot run here (one line), or None."""
    from megatron_siamese.inference.dynamic import dynamic_engine_problem

    if engine not in ENGINES:
        return f"--engine must be one of {', '.join(ENGINES)} (got {engine!r})"
    return dynamic_engine_problem() if engine == "dynamic" else None


def inference_wrapper(model, max_batch_size: int, max_sequence_length: int, vocab_size: int, context=None):
    """Megatron's inference wrapper of ``model`` with ``context``, by default a static KV cache."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_siamese.runtime.gpt import packs_streams

    wrapper_class = _wrapper_class()
    if context is None:
        context = StaticInferenceContext(max_batch_size, max_sequence_length)
    if "inference_wrapper_config" in inspect.signature(wrapper_class.__init__).parameters:  # megatron-core < 0.19
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

        config = InferenceWrapperConfig(
            hidden_size=model.config.hidden_size, params_dtype=model.config.params_dtype,
            # above it, PP splits a batch into microbatches: one batch here
            inference_batch_times_seqlen_threshold=max_batch_size * max_sequence_length + 1,
            padded_vocab_size=vocab_size, inference_max_requests=max_batch_size,
            inference_max_seq_length=max_sequence_length)
        wrapper = wrapper_class(model, config, context)
    else:
        wrapper = wrapper_class(model, context)
    wrapper.packs_streams = packs_streams([model])
    return wrapper


def build_engine(session, max_requests: int, sampling: Sampling, engine: str = "static"):
    """Megatron's ``engine`` ("static" or "dynamic") over this rank's chunk, for ``max_requests`` prompts."""
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_siamese.inference import dynamic

    if len(session.chunks) != 1:
        raise ConfigError(["Megatron's inference wrapper runs no virtual pipeline stages: generate without --vpp"])
    if session.chunks[0].config.mtp_num_layers:  # megatron-core 0.16 would run the heads and want labels
        raise ConfigError(["generation runs the model without its multi-token prediction layers: "
                           "open the session with open_session(..., with_mtp=False)"])
    if engine not in ENGINES:
        raise ConfigError([engine_problem(engine)])
    model, length = session.chunks[0], session.settings.seq_length
    # the controller seeds its sampler from the model's config (megatron-core 0.16.1 and 0.19.2)
    model.config.inference_sampling_seed = sampling.seed
    context = dynamic.dynamic_context(model, max_requests, length) if engine == "dynamic" else None
    wrapper = inference_wrapper(model, max_requests, length, session.vocab_size, context)
    controller = TextGenerationController(wrapper, InferenceTokenizer())
    if engine == "dynamic":
        return dynamic.dynamic_engine(controller, wrapper.inference_context, sampling.seed)
    return StaticInferenceEngine(controller, max_batch_size=max_requests, random_seed=sampling.seed, legacy=True)


@contextlib.contextmanager
def process_inference_flag_kept():
    """megatron-core 0.19's engines leave the process marked as inferring (GPTModel then refuses an ordinary
    forward): put the flag back as found, for longer-lived processes (the Python API, the tests)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        yield
        return
    was = InferenceMode.is_active()
    try:
        yield
    finally:
        if not was:
            InferenceMode.unset_active()


def generate_on_ranks(session, prompts: Sequence[str], max_new_tokens: int, sampling: Sampling,
                      engine: str = "static") -> List[Generation]:
    """On every rank of the session's job: the prompts' continuations (every rank returns them). Trusts its
    caller's ``engine`` (the tests run the dynamic one on CPU with a stand-in attention kernel)."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_siamese.inference.dynamic import generated_tokens

    tokenizer = InferenceTokenizer()
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            num_tokens_to_generate=max_new_tokens)
    with torch.no_grad(), process_inference_flag_kept():
        megatron_engine = build_engine(session, len(prompts), sampling, engine)
        if engine == "dynamic":
            tokens = generated_tokens(megatron_engine.generate(prompts=list(prompts), sampling_params=params))
        else:
            requests = megatron_engine.generate(prompts=list(prompts), sampling_params=params)
            tokens = [[int(t) for t in (r.generated_tokens.tolist() if torch.is_tensor(r.generated_tokens)
                                        else r.generated_tokens)] for r in requests]
    return [Generation(prompt, tokenizer.detokenize(ids), ids) for prompt, ids in zip(prompts, tokens)]


def _generate_rank(checkpoint: str, layout: Layout, prompts: List[str], max_new_tokens: int, sampling: Sampling,
                   engine: str = "static"):
    from megatron.core.inference.engines import static_engine

    from megatron_siamese.inference.session import open_session

    session = open_session(checkpoint, layout, seed=sampling.seed, with_mtp=False,
                           fused_ops=False if _on_cpu() else None)
    if torch.distributed.get_rank() != 0:  # the static engine's progress bar, drawn by rank 0 alone
        static_engine.tqdm = functools.partial(static_engine.tqdm, disable=True)
    try:
        return generate_on_ranks(session, prompts, max_new_tokens, sampling, engine)
    finally:
        session.close()


def _on_cpu() -> bool:
    from megatron_siamese import device

    return not device.uses_cuda()


def generate(checkpoint: str, prompts: Sequence[str], max_new_tokens: int = 32, sampling: Sampling = Sampling(),
             layout: Layout = Layout(), engine: str = "static") -> List[Generation]:
    """The continuations of ``prompts`` by the model in ``checkpoint``, run at ``layout``; every problem with
    the input is refused before any rank starts (ConfigError)."""
    from megatron_siamese.inference.session import layout_problems, model_settings, read_checkpoint
    from megatron_siamese.runtime.launch import run_job
    from megatron_siamese.training.checkpoint_files import CheckpointError

    try:
        saved = read_checkpoint(checkpoint)
        settings = model_settings(saved)
    except CheckpointError as error:
        raise ConfigError([str(error)]) from None
    found = sampling.problems() + prompt_problems(prompts, max_new_tokens, settings.seq_length)
    found += layout_problems(settings, layout, vocab_size=saved.vocab_size)
    if layout.vpp is not None:
        found.append("Megatron's inference wrapper runs no virtual pipeline stages: generate without --vpp")
    if engine == "static" and layout.sp and (layout.tp == 1 or layout.ep == 1):  # else Megatron's controller
        # raises on the ranks (its static path; the dynamic one has its own SP handling)
        found.append(f"--sp with --tp {layout.tp} --ep {layout.ep}: Megatron's static engine runs sequence parallelism "
                     "only in MoE layers under --tp > 1 and --ep > 1 (it turns SP off elsewhere): drop --sp, or for "
                     "a MoE model under --tp add --ep 2 or more")
    if layout.dp != 1 or layout.cp != 1:
        found.append(f"generate runs one model replica: use --dp 1 (got layout {layout.name})")
    refused_engine = engine_problem(engine)
    if refused_engine:
        found.append(refused_engine)
    if engine == "dynamic" and settings.multi_latent_attention:
        found.append(MLA_DYNAMIC_REFUSED)
    if found:
        raise ConfigError(found)
    return run_job(_generate_rank, layout.world_size, checkpoint, layout, list(prompts), max_new_tokens, sampling,
                   engine, needs=f"layout {layout.name}")
