"""One SiameseNorm layer against one stock Pre-Norm layer: forward + backward time on the GPU.

    layer-bench      tier 1, Megatron's local modules, bf16, h = 2048 and 4096, seq 4096,
                     SiameseNorm with the fused ops on and off
    te-layer-bench   tier 2, Transformer Engine modules at a 1.3B-like shape (h = 2048,
                     ffn 5632, 16 heads, seq 4096), bf16 and FP8 (delayed scaling)

Both layers are built from their specs exactly as a GPTModel builds them, with global layer
number 2 of 4 (so SiameseNorm gets packed [s, b, 2h] streams, as every layer but the first
does); the stock layer gets [s, b, h]. Time: the median of CUDA-event-timed forward +
backward iterations after warm-up. Target: SiameseNorm / stock <= 1.05.

    python bench/gpu/layers.py layer-bench --result out.json [--rehearse]
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

from common import NeedsGPU, one_rank, require_gpu, step_main, time_ms

LAYER_NUMBER, NUM_LAYERS = 2, 4
ITERS, WARMUP = 20, 5


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    ffn: int
    seq: int = 4096  # micro-batch 1


LOCAL_SHAPES = (Shape(2048, 16, 5632), Shape(4096, 32, 11008))
TE_SHAPES = (Shape(2048, 16, 5632),)
REHEARSAL_SHAPE = Shape(64, 4, 128, seq=32)


def settings(shape: Shape, norm: str, impl: str, fused_ops=None, fp8=None):
    from megatron_siamese.runtime.settings import ModelSettings

    return ModelSettings(norm=norm, num_layers=NUM_LAYERS, hidden_size=shape.hidden,
                         num_attention_heads=shape.heads, ffn_hidden_size=shape.ffn, seq_length=shape.seq,
                         normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, dtype="bf16",
                         fused_ops=fused_ops, transformer_impl=impl, fp8=fp8, fp8_recipe="delayed")


def layer_spec(norm: str, impl: str, config):
    """The layer spec a GPTModel of scheme ``norm`` would use, local or Transformer Engine."""
    if impl == "transformer_engine":
        if norm == "pre":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec()
        from megatron_siamese.specs import get_siamese_layer_te_spec

        return get_siamese_layer_te_spec()
    from megatron_siamese.models import scheme

    return scheme(norm).block_spec(config, None).layer_specs[0]


def time_layer(model, rehearse: bool) -> dict:
    """Forward + backward of one layer built from ``model`` (ModelSettings), in milliseconds."""
    import torch
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.spec_utils import build_module

    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.runtime.layout import Layout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformer_config(model, Layout())
    spec = layer_spec(model.norm, model.transformer_impl, config)
    if model.transformer_impl == "transformer_engine":
        require_gpu(rehearse, f"building a Transformer Engine {model.norm} layer")
    layer = build_module(spec, config=config, layer_number=LAYER_NUMBER).to(device)
    width = model.hidden_size * (1 if model.norm == "pre" else 2)
    x = torch.randn(model.seq_length, 1, width, device=device, dtype=torch.bfloat16, requires_grad=True)

    def precision():  # Megatron's per-layer FP8 context (a fresh one each forward), or none
        return get_fp8_context(config, LAYER_NUMBER - 1) if model.fp8 else contextlib.nullcontext()

    with precision():
        out, _ = layer(hidden_states=x, attention_mask=None)
    grad = torch.randn_like(out)

    def forward_backward():
        x.grad = None
        with precision():
            out, _ = layer(hidden_states=x, attention_mask=None)
        out.backward(grad)

    iters, warmup = (2, 1) if rehearse else (ITERS, WARMUP)
    ms = time_ms(forward_backward, iters, warmup)
    record = {"ms": round(ms, 3)}
    if hasattr(layer, "stream_arithmetic"):  # which path SiameseNorm's stream arithmetic took
        record["stream_arithmetic"] = type(layer.stream_arithmetic.on(x.device)).__name__
    return record


def release_memory() -> None:
    """Return the last layer's blocks to the GPU, so each layer starts from the same state."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(time_one, *args) -> dict:
    """time_one(*args), or {"error": ...} when it fails: one failing layer leaves the others
    their rows (a rehearsal's stop at the first GPU call still ends the step)."""
    try:
        return time_one(*args)
    except NeedsGPU:
        raise
    except Exception as error:  # noqa: BLE001 - the error's text is the result
        return {"error": f"{type(error).__name__}: {error}"[:800]}
    finally:
        release_memory()


def compare(shapes, impl: str, variants, rehearse: bool) -> list:
    """Rows of {shape, precision, stock ms, SiameseNorm ms per variant, ratios} (runs in a rank)."""
    rows = []
    for shape in shapes:
        for fp8 in variants["fp8"]:
            row = {"hidden": shape.hidden, "heads": shape.heads, "ffn": shape.ffn, "seq": shape.seq,
                   "impl": impl, "precision": "fp8-delayed" if fp8 else "bf16"}
            row["stock"] = attempt(time_layer, settings(shape, "pre", impl, fp8=fp8), rehearse)
            for label, fused in variants["siamese"]:
                timing = attempt(time_layer, settings(shape, "siamese", impl, fused_ops=fused, fp8=fp8), rehearse)
                if "ms" in timing and "ms" in row["stock"]:
                    timing["ratio_to_stock"] = round(timing["ms"] / row["stock"]["ms"], 3)
                row[f"siamese_{label}"] = timing
            rows.append(row)
    return rows


def layer_bench(rehearse: bool) -> dict:
    if not rehearse:
        require_gpu(False, "the layer bench")
    shapes = (REHEARSAL_SHAPE,) if rehearse else LOCAL_SHAPES
    variants = {"fp8": (None,), "siamese": (("fused", True), ("unfused", False))}
    return {"rows": one_rank(compare, shapes, "local", variants, rehearse), "iters": ITERS, "warmup": WARMUP}


def te_layer_bench(rehearse: bool) -> dict:
    if not rehearse:
        require_gpu(False, "the Transformer Engine layer bench")
    for norm in ("pre", "siamese"):  # both specs resolve before any rank starts (a rehearsal stops at the build)
        layer_spec(norm, "transformer_engine", config=None)
    shapes = (REHEARSAL_SHAPE,) if rehearse else TE_SHAPES
    variants = {"fp8": (None, "hybrid"), "siamese": (("fused", True),)}
    return {"rows": one_rank(compare, shapes, "transformer_engine", variants, rehearse),
            "iters": ITERS, "warmup": WARMUP}


STEPS = {"layer-bench": layer_bench, "te-layer-bench": te_layer_bench}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
