"""``megatron-siamese generate``: prompts continued by Megatron's inference engine (inference/generate.py)."""

from __future__ import annotations

import argparse
import json

from megatron_siamese.cli import flags
from megatron_siamese.training.args import ConfigError


def add_parser(commands, name: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name, help="continue prompts with a checkpoint's model (Megatron's inference engine, KV cache)",
        description="Greedy (default) or sampled continuations of the prompts, batched, by the model of a "
                    "checkpoint saved at any layout, run at the layout given here (docs/inference.md).",
        formatter_class=flags.HelpFormatter)
    parser.add_argument("--load", required=True, metavar="CHECKPOINT",
                        help="a run's directory (scripts/run.sh's runs/<time>), its checkpoints directory or one iter_<N> in it; "
                             "the model settings are the checkpoint's")
    parser.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                        help="a prompt (repeat the flag for several: they are generated as one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (fewer if "
                        "end-of-document comes first)")
    sampling = parser.add_argument_group("sampling (any of these samples; none: greedy)")
    sampling.add_argument("--temperature", type=float, default=None, help="softmax temperature (sampling with it unset: 1.0)")
    sampling.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest (0: all; sampling with it unset: 0)")
    sampling.add_argument("--top-p", type=float, default=None, help="sample within this probability mass (0: off; sampling with it unset: 0)")
    parser.add_argument("--seed", type=int, default=1234, help="the sampler's seed (the same seed repeats)")
    parser.add_argument("--engine", choices=("static", "dynamic"), default="static",
                        help="Megatron's inference engine: static (its static KV cache; CPU and GPU) or dynamic "
                             "(its paged KV cache; a GPU with flash-attn >= 2.7.3 only, refused elsewhere)")
    layout = parser.add_argument_group("parallelism")
    layout.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1,
                        help="tensor-parallel size")
    layout.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1,
                        help="pipeline-parallel size")
    layout.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1,
                        help="expert-parallel size (MoE models): --ep x --etp must divide --tp")
    layout.add_argument("--expert-tensor-parallel-size", "--etp", dest="etp", type=int, default=None,
                        help="tensor-parallel size of the experts (unset: --tp)")
    layout.add_argument("--sequence-parallel", "--sp", dest="sp", action="store_true",
                        help="sequence parallelism (MoE models under --tp > 1 need it, with --ep > 1: Megatron's "
                             "static engine runs it in MoE layers only)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {prompt, text, tokens}")
    return parser


def _sampling(options: argparse.Namespace):
    from megatron_siamese.inference.generate import Sampling

    if options.temperature is None and options.top_k is None and options.top_p is None:
        return Sampling(seed=options.seed)  # greedy
    return Sampling(temperature=1.0 if options.temperature is None else options.temperature,
                    top_k=0 if options.top_k is None else options.top_k,
                    top_p=0.0 if options.top_p is None else options.top_p, seed=options.seed)


def _layout(options: argparse.Namespace):
    from megatron_siamese.runtime.layout import Layout

    sizes = {"--tp": options.tp, "--pp": options.pp, "--ep": options.ep, "--etp": options.etp}
    small = [f"{flag} must be at least 1 (got {value})" for flag, value in sizes.items()
             if value is not None and value < 1]
    if small:
        raise ConfigError(small)
    try:
        return Layout(tp=options.tp, pp=options.pp, ep=options.ep, etp=options.etp, sp=options.sp)
    except ValueError as error:
        raise ConfigError([f"{error} (generate runs one model replica: --ep x --etp must divide --tp)"]) from None


def run(options: argparse.Namespace) -> int:
    from megatron_siamese.inference.generate import generate
    from megatron_siamese.runtime.job import console

    results = generate(options.load, options.prompt, options.max_new_tokens, _sampling(options), _layout(options),
                       options.engine)
    if results is None:  # a launched job's other ranks: rank 0 speaks
        return 0
    if options.json:
        console(json.dumps([{"prompt": r.prompt, "text": r.text, "tokens": r.tokens} for r in results]))
    else:
        for i, result in enumerate(results):
            console(f"--- prompt {i + 1}: {result.prompt!r}\n{result.prompt}{result.text}")
    return 0
