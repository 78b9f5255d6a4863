"""After pretraining: the model session (a checkpoint's weights without the trainer) and text
generation through Megatron's inference engine with its KV cache, against a full re-forward.

One tiny randomly initialised SiameseNorm checkpoint (saved at PP2, so every load reshards) is
shared by the module; its init is wide (std 0.2) and its output layer its own (a tied one echoes the last token) so that the greedy continuations depend on the
context, and a broken cache shows."""

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from saved_models import load_full_model, save_random

from megatron_siamese import device
from megatron_siamese.inference.generate import InferenceTokenizer, Sampling, generate, generate_on_ranks
from megatron_siamese.inference.session import open_session, read_checkpoint
from megatron_siamese.runtime.launch import RankFailed, launch
from megatron_siamese.runtime.layout import Layout
from megatron_siamese.runtime.registry import ConfigError
from megatron_siamese.training.args import TrainArgs
from megatron_siamese.training.checkpoint_files import CheckpointError

REPO = Path(__file__).resolve().parent.parent
OLD_CHECKPOINT = REPO / "tests" / "data" / "step_layout" / "checkpoints"  # records no model settings
PROMPTS = ["In the beginning", "And God said, Let there be"]  # two lengths: the batch is padded
NEW_TOKENS = 6
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, init_method_std=0.2,
             share_embeddings_and_output_weights=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("random") / "checkpoints"
    args = TrainArgs(**MODEL, tp=1, pp=2, micro_batch_size=1, global_batch_size=1, output_dir=str(directory.parent))
    launch(save_random, 2, args, str(directory))
    return str(directory)


def greedy_without_cache(model, prompt: str, max_new_tokens: int) -> List[int]:
    """Greedy continuation by re-running ``model`` (one rank, TP = PP = 1, built without MTP
    layers) on the whole sequence at every step, no inference context: what the KV-cached engine
    must reproduce token for token (it stops at end-of-document, as Megatron's controller does)."""
    tokenizer = InferenceTokenizer()
    tokens = tokenizer.tokenize(prompt)
    generated = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids = torch.tensor([tokens], device=device.current())
            positions = torch.arange(len(tokens), device=device.current()).unsqueeze(0)
            mask = torch.tril(torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=device.current()))
            logits = model(ids, positions, ~mask.view(1, 1, len(tokens), len(tokens)))
            # over the padded vocabulary, as Megatron's sampler picks (a trained model gives the
            # padding rows, never a target, no weight; their ids decode to no text)
            next_token = int(logits[0, -1].argmax())
            generated.append(next_token)
            tokens.append(next_token)
            if next_token == tokenizer.eod:
                break
    return generated


def _uncached(checkpoint, prompts, new_tokens):
    session = open_session(checkpoint)
    try:
        return [greedy_without_cache(session.chunks[0], prompt, new_tokens) for prompt in prompts]
    finally:
        session.close()


@pytest.fixture(scope="module")
def uncached(checkpoint):
    """Greedy by re-running the whole sequence at every step: no inference context, no cache."""
    return launch(_uncached, 1, checkpoint, PROMPTS, NEW_TOKENS)[0]


def test_the_session_reads_the_recorded_model_and_the_full_model(checkpoint):
    saved = read_checkpoint(checkpoint)
    assert (saved.step, saved.model_class, saved.settings.norm) == (3, "gpt", "siamese")
    assert (saved.settings.hidden_size, saved.settings.num_layers, saved.settings.init_method_std) == (32, 2, 0.2)
    full = load_full_model(checkpoint)  # saved over two pipeline stages: both layers here, unsharded
    assert full.step == 3 and full.settings == saved.settings and full.vocab_size == 320
    assert full.state_dict["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (3 * 32, 32)
    assert full.state_dict["embedding.word_embeddings.weight"].shape == (320, 32)
    assert full.tokenizer.detokenize(full.tokenizer.tokenize("Amen")) == "Amen"


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(pp=2)], ids=lambda layout: layout.name)
def test_greedy_with_the_kv_cache_is_greedy_without_it(checkpoint, uncached, layout):
    results = generate(checkpoint, PROMPTS, NEW_TOKENS, Sampling(), layout)
    assert [r.tokens for r in results] == uncached
    assert [r.prompt for r in results] == PROMPTS
    # the continuations depend on the context (else a broken cache could not show)
    assert len({t for tokens in uncached for t in tokens}) > 2


def _generate_with_planted_bug(checkpoint, prompts, new_tokens):
    """Decode steps (one new position per sequence) leave the Y stream without its update."""
    from megatron_siamese.layer import SiameseTransformerLayer

    original = SiameseTransformerLayer.forward

    def dropped_y_update(self, hidden_states, *args, **kwargs):
        packed, context = original(self, hidden_states, *args, **kwargs)
        h = self.config.hidden_size
        if hidden_states.shape[0] == 1 and hidden_states.shape[-1] == 2 * h:
            packed = packed.clone()
            packed[..., h:] = hidden_states[..., h:]
        return packed, context

    SiameseTransformerLayer.forward = dropped_y_update
    session = open_session(checkpoint)
    try:
        return [r.tokens for r in generate_on_ranks(session, prompts, new_tokens, Sampling())]
    finally:
        session.close()


def test_the_comparison_catches_a_layer_that_breaks_decode_steps(checkpoint, uncached):
    planted = launch(_generate_with_planted_bug, 1, checkpoint, PROMPTS, NEW_TOKENS)[0]
    # the shortest prompt's first token comes from the prompt pass (the longer prompt's last tokens go
    # through decode steps: the batch decodes from the shortest prompt's end), which the bug leaves intact
    assert planted[0][0] == uncached[0][0]
    assert planted != uncached


def _generate_through_narrow_pipeline_buffers(checkpoint):
    """Megatron's own receive buffers, [s, b, hidden_size], between the two stages."""
    from megatron_siamese.inference import generate as generation

    original = generation.inference_wrapper

    def narrow(*args, **kwargs):
        wrapper = original(*args, **kwargs)
        wrapper.packs_streams = False
        return wrapper

    generation.inference_wrapper = narrow
    session = open_session(checkpoint, Layout(pp=2))
    return [r.tokens for r in generate_on_ranks(session, PROMPTS[:1], 2, Sampling())]


def test_pipeline_stages_need_the_wide_receive_buffers(checkpoint):
    """What makes PP2 generation work: without the 2h-wide buffers the packed streams do not fit
    (gloo aborts the receiving stage, rank 1, on the size mismatch: no timeout, no other error)."""
    with pytest.raises(RankFailed, match=r"^rank 1 was killed by SIGABRT before reporting$"):
        launch(_generate_through_narrow_pipeline_buffers, 2, checkpoint, timeout_s=120)


def _sampled(checkpoint):
    session = open_session(checkpoint)
    try:
        runs = [Sampling(top_k=0, seed=1), Sampling(top_k=0, seed=1), Sampling(top_k=0, seed=2),
                Sampling(temperature=0.7, top_k=0, top_p=0.9, seed=1)]
        return [[r.tokens for r in generate_on_ranks(session, PROMPTS, NEW_TOKENS, sampling)] for sampling in runs]
    finally:
        session.close()


def test_sampling_repeats_with_its_seed(checkpoint):
    first, again, other_seed, nucleus = launch(_sampled, 1, checkpoint)[0]
    assert first == again
    assert other_seed != first
    assert all(len(tokens) == NEW_TOKENS or tokens[-1] == 256 for tokens in first + nucleus)


@pytest.mark.stack_independent  # refused before any rank starts
def test_bad_input_is_refused_in_one_line(checkpoint, tmp_path):
    def refused(*args, **kwargs):
        with pytest.raises(ConfigError) as error:
            generate(*args, **kwargs)
        assert all("\n" not in problem for problem in error.value.problems)  # one line each
        return "\n".join(error.value.problems)

    assert "more than the 32 the model was trained on" in refused(checkpoint, ["x" * 30], 8)
    assert "--num-attention-heads 4 does not split over --tp 3" in refused(checkpoint, ["x"], 4, layout=Layout(tp=3))
    assert "no virtual pipeline stages" in refused(checkpoint, ["x"], 4, layout=Layout(pp=2, vpp=1))
    assert "--sp with --tp 2 --ep 1: Megatron's static engine runs sequence parallelism only in MoE layers" in refused(
        checkpoint, ["x"], 4, layout=Layout(tp=2, sp=True))
    assert "--top-k or --top-p" in refused(checkpoint, ["x"], 4, Sampling(top_k=5, top_p=0.5))
    assert "records no model settings" in refused(str(OLD_CHECKPOINT), ["x"], 4)
    assert "no such file or directory" in refused(str(tmp_path / "missing"), ["x"], 4).lower()
    with pytest.raises(CheckpointError, match="holds another model"):  # the session refuses another model
        load_full_model(checkpoint, TrainArgs(**{**MODEL, "norm": "pre"}))


def test_the_command_generates_and_refuses(checkpoint, uncached):
    cli = [sys.executable, "-m", "megatron_siamese.cli", "generate", "--load", checkpoint]
    done = subprocess.run([*cli, *[f"--prompt={p}" for p in PROMPTS], "--max-new-tokens", str(NEW_TOKENS),
                           "--tp", "2", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["tokens"] for r in json.loads(done.stdout.strip().splitlines()[-1])] == uncached
    assert done.stderr.count("static requests:   0%") == 1  # Megatron's progress bar, rank 0's only
    refused = subprocess.run([*cli, "--prompt", "x" * 40], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "more than the 32 the model was trained on (--seq-length)" in refused.stderr


def test_a_session_in_a_process_whose_groups_are_up_uses_them(megatron_single_rank, checkpoint, uncached):
    """In-process (a test's single rank): the session uses the groups it finds and leaves them up."""
    from megatron.core import parallel_state

    session = open_session(checkpoint)
    session.close()
    assert parallel_state.model_parallel_is_initialized()
    assert greedy_without_cache(session.chunks[0], PROMPTS[0], NEW_TOKENS) == uncached[0]
    with pytest.raises(ConfigError, match="the layout tp2 uses 2 ranks, the job has 1"):
        open_session(checkpoint, Layout(tp=2))


# Megatron's dynamic engine (paged KV cache): refused on CPU, its wiring run here with a stand-in
# for the one piece CPU lacks, flash-attn's paged attention kernels (docs/inference.md).

def _paged_attention(q, k_cache, v_cache, query_lengths, key_lengths, block_table, softmax_scale, forget_cache):
    """Plain-PyTorch attention of each request's queries over its keys in the paged cache,
    causal aligned at the end (flash-attn's convention), as flash-attn's paged kernels compute."""
    outputs = []
    softmax_scale = softmax_scale or k_cache.shape[-1] ** -0.5  # flash-attn's default
    for i, (n_q, n_k) in enumerate(zip(query_lengths, key_lengths)):
        blocks = block_table[i, :-(-n_k // k_cache.shape[1])].long()
        keys = k_cache[blocks].flatten(0, 1)[:n_k]
        values = v_cache[blocks].flatten(0, 1)[:n_k]
        if forget_cache:  # planted bug: earlier positions' cached keys and values go unread
            keys, values, n_k = keys[-n_q:], values[-n_q:], n_q
        repeat = q[i].shape[-2] // keys.shape[-2]  # grouped-query heads
        keys, values = keys.repeat_interleave(repeat, -2), values.repeat_interleave(repeat, -2)
        scores = torch.einsum("qhd,khd->hqk", q[i][:n_q].float(), keys.float()) * softmax_scale
        visible = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", weights, values.float()).to(q[i].dtype))
    return outputs


class _Setattr:
    """monkeypatch.setattr on a launched rank (which ends with the job)."""

    @staticmethod
    def setattr(owner, name, value, raising=True):
        setattr(owner, name, value)


def _dynamic_on_rank(checkpoint, layout):
    return _run_dynamic_on_cpu(_Setattr(), checkpoint, layout=layout)


def _run_dynamic_on_cpu(monkeypatch, checkpoint, forget_cache=False, layout=Layout()):
    """Greedy through Megatron's DynamicInferenceEngine on this CPU rank: flash-attn's two paged
    kernels replaced by ``_paged_attention``, Megatron's gate for them passed, its own PyTorch
    KV append instead of the Triton one (Triton needs a GPU), NVTX ranges off (CPU torch)."""
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.transformer import attention

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, block_table=None, **unused):
        assert causal and not unused.get("return_attn_probs")
        q_lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        pieces = [q[int(start):int(start) + n] for start, n in zip(cu_q[:-1].tolist(), q_lengths)]
        out = q.new_zeros(q.shape)  # padding tokens past the last request stay zero
        out[:int(cu_q[-1])] = torch.cat(_paged_attention(pieces, k, v, q_lengths, (cu_k[1:] - cu_k[:-1]).tolist(),
                                                         block_table, softmax_scale, forget_cache))
        return out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale=None, causal=True, block_table=None, **unused):
        assert causal and not unused.get("return_softmax_lse")
        out = _paged_attention(q, k_cache, v_cache, [q.shape[1]] * q.shape[0], cache_seqlens.tolist(), block_table,
                               softmax_scale, forget_cache)
        return torch.stack(out)

    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", with_kvcache)
    monkeypatch.setattr(attention, "is_fa_min_version", lambda *args, **kwargs: True)
    if attention.rearrange is None:  # einops, which flash-attn installs: the one pattern Megatron uses here
        monkeypatch.setattr(attention, "rearrange", lambda x, pattern: x.flatten(2) if pattern == "s b h d -> s b (h d)"
                            else pytest.fail(f"rearrange {pattern!r}"))
    monkeypatch.setattr(dynamic_context, "triton_append_key_value_cache", None, raising=False)
    monkeypatch.setattr(dynamic_engine, "range_push", lambda *args, **kwargs: None, raising=False)
    monkeypatch.setattr(dynamic_engine, "range_pop", lambda *args, **kwargs: None, raising=False)
    session = open_session(checkpoint, layout)
    try:
        return [r.tokens for r in generate_on_ranks(session, PROMPTS, NEW_TOKENS, Sampling(), engine="dynamic")]
    finally:
        session.close()


@pytest.mark.stack_independent  # refused before any rank starts
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the dynamic engine is not refused for want of one")
def test_the_dynamic_engine_is_refused_on_cpu(checkpoint):
    with pytest.raises(ConfigError, match=r"--engine dynamic needs a GPU: .*flash_decode_and_prefill.*--engine static"):
        generate(checkpoint, PROMPTS, NEW_TOKENS, engine="dynamic")


def test_the_dynamic_engine_greedy_is_greedy_without_cache(megatron_single_rank, monkeypatch, checkpoint, uncached):
    """Megatron's dynamic engine, paged cache and ragged token batches, over the SiameseNorm model:
    the same tokens as the full re-forward, given a correct paged attention kernel; a kernel
    that ignores the cache does not pass."""
    from megatron_siamese.inference import dynamic
    from megatron_siamese.inference.generate import build_engine, process_inference_flag_kept

    session = open_session(checkpoint)
    with process_inference_flag_kept():
        engine = build_engine(session, len(PROMPTS), Sampling(), "dynamic")
    assert isinstance(engine.context, __import__(
        "megatron.core.inference.contexts.dynamic_context", fromlist=["x"]).DynamicInferenceContext)
    allocator = getattr(engine.context, "kv_block_allocator", None) or engine.context.block_allocator
    # blocks for the active requests (after 0.19 the pool minus the paused limit and the dummy block)
    active_blocks = getattr(allocator, "active_count", None) or allocator.pool_size - allocator.paused_limit - 1
    assert active_blocks >= len(PROMPTS)  # a 256-token block per prompt of <= 32 tokens
    assert engine.context.block_size_tokens == dynamic.BLOCK_SIZE_TOKENS
    assert type(engine.controller.inference_wrapped_model).__name__ == "SiameseGPTInferenceWrapper"
    assert _run_dynamic_on_cpu(monkeypatch, checkpoint) == uncached
    assert _run_dynamic_on_cpu(monkeypatch, checkpoint, forget_cache=True) != uncached
    assert not inference_flag_set()  # the process's own forwards still work afterwards


def inference_flag_set() -> bool:
    """megatron-core 0.19's process-wide 'an engine is inferring' flag (0.16 has none)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    return InferenceMode.is_active()


def test_the_dynamic_engine_over_two_pipeline_stages(checkpoint, uncached):
    """The packed streams cross the stages through the dynamic engine's ragged token batches too
    (the wide receive buffers); TP2 gave the same tokens when run by hand (docs/inference.md)."""
    assert launch(_dynamic_on_rank, 2, checkpoint, Layout(pp=2))[0] == uncached


# Multi-token prediction: generation predicts with the decoder and its output layer alone, as
# Megatron's inference does; its MTP heads stay in the checkpoint, unread.
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8,
           v_head_dim=8, qk_layernorm=True, add_bias_linear=False)
DEEPSEEK_SHAPED = dict(MLA, num_moe_experts=4, moe_layer_freq="[0,1]", moe_shared_expert_intermediate_size=64)


def _save_with_mtp(args, directory, prompts, new_tokens):
    """An MTP model's checkpoint, and greedy without cache by a model built without MTP layers that
    holds the same weights (every key but the MTP block's, loaded strictly)."""
    from megatron_siamese.training.checkpoint import save_model
    from megatron_siamese.models import build_model_chunks
    from megatron_siamese.runtime.gpt import MegatronGPT, initialize_model_parallel, transformer_config
    from megatron_siamese.training.args import padded_vocab_size

    initialize_model_parallel(args.layout, args.seed)
    chunks = build_model_chunks(transformer_config(args, args.layout), args, padded_vocab_size())
    path = save_model(chunks, args, directory, step=3)
    plain = build_model_chunks(transformer_config(args, args.layout, mtp_num_layers=None), args, padded_vocab_size())[0]
    state = chunks[0].state_dict()
    assert any(key.startswith("mtp.") for key in state)
    plain.load_state_dict({key: value for key, value in state.items() if not key.startswith("mtp.")})
    plain.eval()
    expected = [greedy_without_cache(plain, prompt, new_tokens) for prompt in prompts]
    MegatronGPT.close()
    return path, expected


@pytest.mark.parametrize("model, layout", [
    ({}, Layout(pp=2)),  # the MTP block's stage
    (MLA, Layout(tp=2)),  # MLA under TP without SP: the rule asking for SP is training's (its gradients)
    (DEEPSEEK_SHAPED, Layout(tp=2, ep=2, etp=1, sp=True)),  # Megatron's inference turns SP off outside MoE layers
], ids=["dense", "mla", "mla-moe"])
def test_generation_from_an_mtp_checkpoint_is_the_model_without_mtp(tmp_path, model, layout):
    """The MTP checkpoint's greedy continuations are those of the same weights without MTP layers
    (megatron-core 0.16 failed asking the MTP heads for labels), through the KV cache on every rank
    of the layout; the weights are saved under another seed than the session builds with, so that
    a weight left unloaded shows."""
    args = TrainArgs(**MODEL, **model, mtp_num_layers=1, seed=7, tp=1, pp=1, micro_batch_size=1,
                     global_batch_size=1, output_dir=str(tmp_path))
    path, expected = launch(_save_with_mtp, 1, args, str(tmp_path / "checkpoints"), PROMPTS, NEW_TOKENS)[0]
    assert [r.tokens for r in generate(path, PROMPTS, NEW_TOKENS, layout=layout)] == expected
    assert len({t for tokens in expected for t in tokens}) > 2  # context-dependent: a wrong weight shows
    if model.get("multi_latent_attention"):  # Megatron's dynamic engine takes MLA only with FlashMLA's latent cache
        with pytest.raises(ConfigError, match=r"--engine dynamic with multi-latent attention .*use --engine static"):
            generate(path, PROMPTS, NEW_TOKENS, engine="dynamic")
