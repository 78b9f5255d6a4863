"""One SiameseNorm layer against one stock Pre-Norm layer: forward + backward time on the GPU.

    layer-bench      tier 1, Megatron's local modules, bf16, h = 2048 (ffn 5632) and 4096
                     (ffn 11008), seq 4096: SiameseNorm with the fused ops (each CUDA kernel
                     generation) and without them (the PyTorch path); target <= 1.05x
    te-layer-bench   tier 2, Transformer Engine modules at the same shapes (16 / 32 heads), bf16,
                     FP8 delayed and FP8 current (tensorwise) scaling, SiameseNorm with the
                     fused ops per generation; targets <= 1.03x at h 2048, <= 1.02x at h 4096
    host-cost        tier 1, bench/host_cost.py's layers (h 64, seq 8) on the GPU: host time, ops
                     and autograd nodes beside stock; targets <= 1.05x time, <= 1.10x ops

Both layers are built from their specs exactly as a GPTModel builds them, with global layer
number 2 of 4 (so SiameseNorm gets packed [s, b, 2h] streams, as every layer but the first
does); the stock layer gets [s, b, h]. A row builds its layers once and times them in turn,
REPEATS times over (so the spread shows); each time is the median of ITERS CUDA-event-timed
forward + backward iterations after WARMUP. A row's variants: ``stock``, ``siamese_fused``
(the verified kernels, a dual_norm and a dual_residual per sublayer), ``siamese_fused_tiled``
(the same layer, tiled kernels), ``siamese_joined`` (the two sublayers joined by the boundary
ops, ``siamese_boundary_ops=True``: their CUDA kernels' first run) and, local only,
``siamese_unfused``; each records ``ms`` (mean of the repeats), ``ms_repeats`` and, for
SiameseNorm, ``ratios`` per repeat and ``ratio_to_stock`` (the larger), ``kernels``.

    python bench/gpu/layers.py layer-bench --result out.json [--rehearse]
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Optional

from common import (PRECISIONS, ROOT, NeedsGPU, cuda_kernels, one_rank, repeated, require_gpu, seconds_left,
                    step_main, time_ms)

LAYER_NUMBER, NUM_LAYERS = 2, 4
ITERS, WARMUP, REPEATS = 20, 5, 2
ROW_MARGIN_S = 20  # a row (three or four layers, each timed twice) at h 4096 fits in this


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    ffn: int
    seq: int = 4096  # micro-batch 1


@dataclass(frozen=True)
class Variant:
    norm: str  # "pre" (stock) or "siamese"
    fused_ops: Optional[bool] = None
    kernels: Optional[str] = None  # the CUDA kernel generation it runs
    boundary_ops: Optional[bool] = False  # the boundary ops join the sublayers (opt-in on CUDA)

    @property
    def layer(self) -> tuple:
        """What tells its layer apart (variants differing only in kernels share one)."""
        return self.norm, self.fused_ops, self.boundary_ops


SHAPES = (Shape(2048, 16, 5632), Shape(4096, 32, 11008))
REHEARSAL_SHAPE = Shape(64, 4, 128, seq=32)
STOCK = Variant("pre")
FUSED = {"siamese_fused": Variant("siamese", True, "verified"),
         "siamese_fused_tiled": Variant("siamese", True, "tiled"),
         "siamese_joined": Variant("siamese", True, "verified", boundary_ops=True)}
LOCAL_VARIANTS = {"stock": STOCK, **FUSED, "siamese_unfused": Variant("siamese", False)}
TE_VARIANTS = {"stock": STOCK, **FUSED}


def settings(shape: Shape, variant: Variant, impl: str, precision: str = "bf16"):
    from megatron_siamese.runtime.settings import ModelSettings

    return ModelSettings(norm=variant.norm, num_layers=NUM_LAYERS, hidden_size=shape.hidden,
                         num_attention_heads=shape.heads, ffn_hidden_size=shape.ffn, seq_length=shape.seq,
                         normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, dtype="bf16",
                         fused_ops=variant.fused_ops, boundary_ops=variant.boundary_ops, transformer_impl=impl,
                         **PRECISIONS[precision])


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


def build_layer(model, rehearse: bool) -> tuple:
    """(forward + backward of one layer built from ``model`` (ModelSettings), its record so far)."""
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

    record = {}
    if hasattr(layer, "stream_arithmetic"):  # which path SiameseNorm's stream arithmetic took
        record["stream_arithmetic"] = type(layer.stream_arithmetic.on(x.device)).__name__
        record["joined"] = bool(layer.may_join_sublayers and layer.stream_arithmetic.joins(x.device))
    return forward_backward, record


def release_memory() -> None:
    """Return the last layers' blocks to the GPU, so each row starts from the same state."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:800]


def measure_row(shape: Shape, impl: str, precision: str, variants: dict, rehearse: bool) -> dict:
    """One row: each variant's layer built once (the generations share one fused layer), then
    all of them timed in turn, REPEATS times. A failing layer leaves the others their times (a
    rehearsal's stop at the first GPU call still ends the step)."""
    row = {"hidden": shape.hidden, "heads": shape.heads, "ffn": shape.ffn, "seq": shape.seq, "impl": impl,
           "precision": precision}
    built, errors, times = {}, {}, {label: [] for label in variants}
    for label, variant in variants.items():
        key = variant.layer
        if key not in built:
            try:
                built[key] = build_layer(settings(shape, variant, impl, precision), rehearse)
            except NeedsGPU:
                raise
            except Exception as error:  # noqa: BLE001 - the error's text is the result
                built[key] = error
        if isinstance(built[key], Exception):
            errors[label] = error_text(built[key])
    iters, warmup = (2, 1) if rehearse else (ITERS, WARMUP)
    for _ in range(REPEATS):
        for label, variant in variants.items():
            if label in errors:
                continue
            try:
                with cuda_kernels(variant.kernels):
                    times[label].append(time_ms(built[variant.layer][0], iters, warmup))
            except Exception as error:  # noqa: BLE001
                errors[label] = error_text(error)
    for label, variant in variants.items():
        if label in errors:
            row[label] = {"error": errors[label]}
            continue
        stock = times["stock"] if label != "stock" and "stock" not in errors else None
        row[label] = repeated(times[label], stock)
        row[label].update(built[variant.layer][1])
        if variant.kernels:
            row[label]["kernels"] = variant.kernels
    del built
    release_memory()
    return row


def compare(shapes, impl: str, variants: dict, precisions, rehearse: bool) -> dict:
    """Rows of {shape, precision, stock, SiameseNorm per variant} (runs in a rank), in order, as
    far as the step's deadline allows."""
    rows, cut = [], []
    for shape in shapes:
        for precision in precisions:
            if seconds_left() < ROW_MARGIN_S:
                cut.append(f"h={shape.hidden} {precision}")
                continue
            rows.append(measure_row(shape, impl, precision, variants, rehearse))
    return {"rows": rows, "cut_for_time": cut}


def layer_bench(rehearse: bool) -> dict:
    if not rehearse:
        require_gpu(False, "the layer bench")
    shapes = (REHEARSAL_SHAPE,) if rehearse else SHAPES
    result = one_rank(compare, shapes, "local", LOCAL_VARIANTS, ("bf16",), rehearse)
    return {**result, "iters": ITERS, "warmup": WARMUP, "repeats": REPEATS}


def te_layer_bench(rehearse: bool) -> dict:
    from megatron_siamese.runtime.gpt import transformer_config
    from megatron_siamese.runtime.layout import Layout

    if not rehearse:
        require_gpu(False, "the Transformer Engine layer bench")
    shapes = (REHEARSAL_SHAPE,) if rehearse else SHAPES
    for norm in ("pre", "siamese"):  # both specs resolve before any rank starts (a rehearsal stops at the build)
        layer_spec(norm, "transformer_engine", config=None)
    for precision in PRECISIONS:  # Megatron validates each precision's config here
        transformer_config(settings(shapes[0], FUSED["siamese_fused"], "transformer_engine", precision), Layout())
    result = one_rank(compare, shapes, "transformer_engine", TE_VARIANTS, tuple(PRECISIONS), rehearse)
    return {**result, "iters": ITERS, "warmup": WARMUP, "repeats": REPEATS}


def host_rows(device: str, repeats: int) -> dict:
    """bench/host_cost.py's rows, in this rank: {"local/bf16": {variant: row}, ...}."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import host_cost

    return {f"{spec}/{dtype}": host_cost.measure(spec, dtype, repeats=repeats, device=device)
            for spec in ("local", "te") for dtype in ("fp32", "bf16")}


def host_cost_step(rehearse: bool) -> dict:
    """host-cost (tier 1): the CPU's host-cost bench (docs/kernels.md, "The host's share") with
    its layers on the GPU, each pass synchronized: at h 64 the kernels finish behind their
    launches, so the time is the host's. The TE spec's op structure is stood in, as on CPU."""
    if not rehearse:
        require_gpu(False, "the host-cost bench")
    repeats = HOST_COST_REHEARSAL_REPEATS if rehearse else HOST_COST_REPEATS
    rows = one_rank(host_rows, "cpu" if rehearse else "cuda", repeats)
    return {"rows": rows, "repeats": repeats, "hidden": 64, "seq": 8}


HOST_COST_REPEATS, HOST_COST_REHEARSAL_REPEATS = 200, 3
STEPS = {"layer-bench": layer_bench, "te-layer-bench": te_layer_bench, "host-cost": host_cost_step}

if __name__ == "__main__":
    sys.exit(step_main(STEPS))
