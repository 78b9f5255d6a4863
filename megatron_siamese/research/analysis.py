"""``megatron-siamese analyze``: what the two streams do in a trained checkpoint (stream contribution, logit
lens per stream, magnitude by depth, effective depth). Single rank, PyTorch path, so every norm is a module
whose output can be observed. docs/research.md, "Analysis".
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron_siamese import device
from megatron_siamese.data.corpus import ByteTokenizer

PRUNE_FRACTIONS = (0.125, 0.25, 0.375, 0.5)


def _batches(args, count: int):
    """Validation batches of the embedded corpus at the model's sequence length."""
    from megatron_siamese.data.corpus import embedded_corpus
    from megatron_siamese.data.gpt_dataset import validation_batches

    return validation_batches(embedded_corpus(args.cache_dir), ByteTokenizer(), args.seq_length, args.seed,
                              args.micro_batch_size, count)


def _loss_from_hidden(model, hidden, labels):
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return F.cross_entropy(logits.float().transpose(0, 1).flatten(0, 1), labels.flatten()).item()


def _forward(model, batch):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]).mean().item()


def _mean_loss(model, batches) -> float:
    return sum(_forward(model, b) for b in batches) / len(batches)


@contextmanager
def skipped(model, indices):
    """Blocks at ``indices`` pass their input through (the first SiameseNorm block still
    starts both streams from the embedding)."""
    saved = {}
    siamese = hasattr(model.decoder.layers[0], "depth_scale")
    for i in indices:
        layer = model.decoder.layers[i]
        saved[i] = layer.forward

        def identity(hidden_states, *args, _first=(i == 0), **kwargs):
            if siamese and _first and hidden_states.shape[-1] == model.config.hidden_size:
                hidden_states = torch.cat([hidden_states, hidden_states], dim=-1)
            return hidden_states.clone(), kwargs.get("context")

        layer.forward = identity
    try:
        yield
    finally:
        for i, forward in saved.items():
            model.decoder.layers[i].forward = forward


def effective_depth(model, batches) -> Dict[str, List[float]]:
    base = _mean_loss(model, batches)
    layers = len(model.decoder.layers)
    per_block = []
    for i in range(layers):
        with skipped(model, [i]):
            per_block.append(_mean_loss(model, batches) - base)
    # distinct block counts: on shallow models several fractions round to the same count
    counts = sorted({max(1, round(fraction * layers)) for fraction in PRUNE_FRACTIONS})
    pruned = []
    for k in counts:
        with skipped(model, range(layers - k, layers)):
            pruned.append(_mean_loss(model, batches) - base)
    return {"base": [base], "skip_block": per_block, "prune_last": pruned, "pruned_blocks": counts}


def stream_probes(model, batches) -> Dict[str, list]:
    """Contributions, logit lens and magnitudes of a SiameseNorm model (block spec)."""
    from megatron_siamese.norms import TorchNorm

    h = model.config.hidden_size
    final = model.decoder.final_layernorm
    captured: Dict[str, list] = {}
    hooks = []

    def keep(name):
        return lambda module, inputs, output: captured.setdefault(name, []).append(
            output[0] if isinstance(output, tuple) else output)

    layers = list(model.decoder.layers)
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(keep(f"out{i}")))
        for sub in ("attn", "mlp"):
            hooks.append(getattr(layer, f"{sub}_x_norm").register_forward_hook(keep(f"{sub}_x{i}")))
            hooks.append(getattr(layer, f"{sub}_y_norm").register_forward_hook(keep(f"{sub}_y{i}")))
    lens = {"x": [0.0] * len(layers), "y": [0.0] * len(layers), "merge": [0.0] * len(layers)}
    try:
        for batch in batches:
            captured.clear()
            _forward(model, batch)
            for i in range(len(layers)):
                packed = captured[f"out{i}"][0]
                x, y = packed[..., :h], packed[..., h:]
                views = {"x": TorchNorm.forward(final, final.merge.x_norm(x)),
                         "y": TorchNorm.forward(final, final.merge.y_norm(y)),
                         "merge": final(packed)}
                for key, hidden in views.items():
                    lens[key][i] += _loss_from_hidden(model, hidden, batch["labels"]) / len(batches)
    finally:
        for hook in hooks:
            hook.remove()
    rms = lambda t: float(t.float().pow(2).mean().sqrt())  # noqa: E731
    weights, activations, magnitude = [], [], {"x": [], "y": []}
    for i, layer in enumerate(layers):
        for sub in ("attn", "mlp"):
            gx = float(getattr(layer, f"{sub}_x_norm").weight.abs().mean())
            gy = float(getattr(layer, f"{sub}_y_norm").weight.abs().mean())
            weights.append(gx / (gx + gy))
            ax, ay = rms(captured[f"{sub}_x{i}"][0]), rms(captured[f"{sub}_y{i}"][0])
            activations.append(ax / (ax + ay))
        packed = captured[f"out{i}"][0]
        magnitude["x"].append(rms(packed[..., :h]))
        magnitude["y"].append(rms(packed[..., h:]))
    return {"x_share_weights": weights, "x_share_activations": activations, "logit_lens": lens,
            "magnitude": magnitude}


def _analyze_rank(args, compare_load: Optional[str], batches: int):
    from megatron_siamese.inference.session import open_session

    results = {}
    runs = [("siamese", args)]
    if compare_load:
        runs.append(("pre", dataclasses.replace(args, norm="pre", load=compare_load)))
    for label, run_args in runs:
        # the weights alone (the model flags must describe the checkpoint's model), no optimizer
        session = open_session(run_args.load, settings=run_args, seed=run_args.seed, fused_ops=False)
        try:
            model = session.chunks[0]
            data = [{k: v.to(device.current()) for k, v in b.items()} for b in _batches(run_args, batches)]
            with torch.no_grad():
                results[label] = {"depth": effective_depth(model, data)}
                if label == "siamese":
                    results[label].update(stream_probes(model, data))
        finally:
            session.close()
    return results


def analyze(args, compare_load: Optional[str] = None, batches: int = 2) -> dict:
    from megatron_siamese.runtime.launch import run_job

    if (args.tp, args.pp) != (1, 1) or not args.load:
        raise ValueError("analyze a checkpoint (--load) at tp=1, pp=1")
    # the probes only evaluate the weights (inference/session.py): no optimizer state is loaded, so
    # neither its kind (a distributed optimizer's state at another layout) nor its schedule stands in the way
    args = dataclasses.replace(args, norm="siamese", fused_ops=False, distributed_optimizer=False)
    results = run_job(_analyze_rank, 1, args, compare_load, batches, needs="analyze")
    os.makedirs(args.output_dir, exist_ok=True)
    plot(results, args.output_dir)
    return results


def format_tables(results: dict) -> str:
    s = results["siamese"]
    lines = ["block  sublayer  X share (weights)  X share (activations)"]
    for i, (w, a) in enumerate(zip(s["x_share_weights"], s["x_share_activations"])):
        lines.append(f"{i // 2 + 1:>5}  {('attn', 'mlp')[i % 2]:>8}  {w:>17.3f}  {a:>21.3f}")
    lines += ["", "block  loss from x  loss from y  loss from merge  RMS x   RMS y"]
    lens, magnitude = s["logit_lens"], s["magnitude"]
    for i in range(len(lens["x"])):
        lines.append(f"{i + 1:>5}  {lens['x'][i]:>11.3f}  {lens['y'][i]:>11.3f}  {lens['merge'][i]:>15.3f}  "
                     f"{magnitude['x'][i]:>6.2f}  {magnitude['y'][i]:>6.2f}")
    lines += ["", "effective depth: loss increase when one block is skipped / the last k of n blocks are dropped"]
    for label, r in results.items():
        depth = r["depth"]
        lines.append(f"{label:>8}: base loss {depth['base'][0]:.3f}; skip block " +
                     " ".join(f"{v:+.3f}" for v in depth["skip_block"]))
        layers = len(depth["skip_block"])
        lines.append(f"{'':>8}  drop last " + " ".join(
            f"{k}/{layers}:{v:+.3f}" for k, v in zip(depth["pruned_blocks"], depth["prune_last"])))
    return "\n".join(lines)


def plot(results: dict, directory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    s = results["siamese"]

    def by_position(values):
        return list(range(1, len(values) + 1)), values

    loss_increase = "loss increase (nats)"
    figures = {  # name: (x label, y label, [(series label, (xs, ys))])
        "contribution.png": ("sublayer (attention, MLP per block)", "share of the X stream", [
            ("X share, weights", by_position(s["x_share_weights"])),
            ("X share, activations", by_position(s["x_share_activations"]))]),
        "logit_lens.png": ("block", "next-token loss (nats)", [
            (f"decode from {k}", by_position(v)) for k, v in s["logit_lens"].items()]),
        "magnitude.png": ("block", "RMS after the block", [
            (f"RMS of {k}", by_position(v)) for k, v in s["magnitude"].items()]),
        "depth.png": ("block skipped", loss_increase, [
            (f"{label}: skip one block", by_position(r["depth"]["skip_block"])) for label, r in results.items()]),
        "pruning.png": ("last blocks dropped", loss_increase, [
            (f"{label}: drop the last k blocks", (r["depth"]["pruned_blocks"], r["depth"]["prune_last"]))
            for label, r in results.items()]),
    }
    for name, (xlabel, ylabel, series) in figures.items():
        figure, axis = plt.subplots(figsize=(6, 4))
        for label, (xs, ys) in series:
            axis.plot(xs, ys, "o-", label=label)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(os.path.join(directory, name), dpi=110)
        plt.close(figure)
