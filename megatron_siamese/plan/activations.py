"""What one microbatch's forward keeps for backward, per model chunk, stock and SiameseNorm.

Per rank, with ``T = s b / cp`` tokens of the microbatch and ``Ts = T / tp`` of them under
sequence parallelism (else ``T``), ``B`` bytes an activation element, each layer keeps (Megatron's
modules, counted as storages: a view keeps its whole storage):

* every sublayer: its residual input, kept by its norm with the norm's fp32 statistics (2 a token
  for LayerNorm, 1 for RMSNorm), and the normalized input its first linear keeps: ``Ts h`` each;
* attention: Q, K and V as they are stored, and its output (the output projection's input,
  ``T a d / tp``): V is a view that keeps the QKV projection's output ``T (a + 2g) d / tp`` whole,
  as Q and K are without RoPE, which makes new ones (``T (a + g) d / tp``); Megatron's local
  ``DotProductAttention`` repeats K and V to every head when ``g < a`` (``3 T a d / tp`` then) and
  keeps the probabilities ``T (a / tp) s`` and RoPE's cosines and sines for Q and K (``4 s d``);
  flash attention keeps its fp32 log-sum-exp (``T a / tp``) instead; dropout adds its masks;
* dense MLP: ``linear_fc1``'s output as the activation keeps it and ``linear_fc2``'s input: GELU
  ``2 T f / tp``; a gated unit ``3 T f / tp`` fused (Transformer Engine, bias-SwiGLU), ``5 T f / tp``
  in Megatron's local composition (the gate's output and the linear half are kept apart);
* MoE MLP: the router and the permutation (fp32 logits, their log-sum-exp and the aux loss's
  scores, a routing map and per-expert probabilities, top-k indices and weights), and the
  experts' MLP over the ``Ts k`` routed token copies (times expert TP; a balanced router: each
  rank's experts get as many as it sends) with the routing weight applied to the activation
  (``6 f`` a copy in Megatron's local gated unit, ``4 f`` fused, ``3 f`` GELU), the shared expert
  as a dense MLP;
* the embedding's token ids (int64), and on the last chunk the final norm, the output layer's
  input and the cross entropy's fp32 probabilities ``T V / tp`` (with its targets and mask).

SiameseNorm changes only the norms and residuals (attention, MLP and head are stock modules on
``h``-wide inputs), by path (``stream_arithmetic.py``, docs/kernels.md):

* ``pytorch``: each sublayer keeps its packed ``[Ts, 2h]`` input (PostNorm's and PreNorm's views),
  InputNorm's input ``u + PreNorm(y)``, and three norms' statistics;
* ``apart`` (fused ``dual_norm`` + ``dual_residual`` per sublayer): each sublayer's packed input
  and 6 statistics;
* ``joined`` (the boundary ops): the layer's packed input once, the attention's output ``z``
  (``Ts h``), 14 statistics;
* the first layer's input is the ``h``-wide embedding (x = y), and the final merge keeps the
  packed streams and two more norms' statistics.

Recompute: ``full`` keeps each layer's input only, and one layer's activations while that layer
is recomputed in backward (its microbatch's head freed by then); ``selective`` (this package's
"layernorm" and "mlp") keeps past the layer's input the MLP sublayer's input (its norms'
checkpoint input; the joined path keeps z and its statistics instead) and the attention, and
brings the MLP and its normalized input back in backward with what the norms keep when they run
again. The peak over the schedule adds that working set once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_siamese.plan.placement import Chunk
from megatron_siamese.plan.shapes import Shape
from megatron_siamese.runtime.layout import Layout

STOCK = "stock"
PATHS = ("pytorch", "apart", "joined")  # SiameseNorm's
STAT = 4  # fp32 statistic a token
IDS = 8  # int64 token id


@dataclass(frozen=True)
class Implementation:
    """How the layers compute, which decides what they keep."""

    bytes: int  # activation element
    attention: str = "unfused"  # "unfused" (probabilities kept) or "flash"
    fused_activation: bool = False  # the MLP's activation keeps its input only
    local_rope: bool = True  # Megatron's unfused RoPE: cosines and sines kept per layer
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0


@dataclass(frozen=True)
class Tokens:
    """A microbatch's tokens on one rank."""

    whole: int  # T = s b / cp
    sharded: int  # T / tp under sequence parallelism, else T
    seq: int  # s / cp


def tokens_of(shape: Shape, layout: Layout, micro_batch: int) -> Tokens:
    whole = shape.seq * micro_batch // layout.cp
    return Tokens(whole, whole // layout.tp if layout.sp else whole, shape.seq // layout.cp)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's kept bytes: its input (the residual streams it receives) and the rest, and what
    its recomputation brings back at once in backward."""

    input: float
    rest: float
    recomputed: float = 0.0

    @property
    def total(self) -> float:
        return self.input + self.rest


def _norm(shape: Shape, tokens: Tokens, impl: Implementation, width: int = 0) -> float:
    """A norm module's input (``width`` wide, 0 if counted elsewhere) and its statistics."""
    return tokens.sharded * (width * impl.bytes + STAT * shape.norm_statistics)


def _attention(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation) -> float:
    """The attention sublayer past its normalized input: Q, K and V as stored, the output, and
    what the kernel keeps."""
    heads, groups = shape.heads // layout.tp, max(shape.groups // layout.tp, 1)
    if impl.attention == "unfused" and groups < heads:  # Megatron's local attention repeats K and V to every head
        qkv = 3 * heads
    else:  # V (and Q, K without RoPE) are views that keep the QKV projection's output whole
        qkv = (heads + groups if shape.rope else 0) + heads + 2 * groups
    per_head = tokens.whole * heads
    kept = tokens.whole * (qkv + heads) * shape.head_dim * impl.bytes
    if impl.attention == "flash":
        kept += per_head * STAT
    else:
        kept += per_head * tokens.seq * layout.cp * impl.bytes  # probabilities over the whole sequence
        if impl.attention_dropout > 0:
            kept += per_head * tokens.seq * layout.cp * (1 + impl.bytes)
        if shape.rope and impl.local_rope:
            kept += 4 * tokens.seq * shape.head_dim * impl.bytes
    return kept


def _mlp_internals(shape: Shape, rows: int, width: int, impl: Implementation) -> float:
    """An MLP's activation and ``linear_fc2`` input for ``rows`` tokens of local width ``width``."""
    if not shape.glu:
        return 2 * rows * width * impl.bytes
    return (3 if impl.fused_activation else 5) * rows * width * impl.bytes


def _router(shape: Shape, tokens: int) -> float:
    """The router and the token permutation for ``tokens`` tokens: fp32 logits, their log-sum-exp
    and the aux loss's scores, a routing map (bool) and the probabilities per expert, the top-k
    indices and probabilities (int64, fp32) kept thrice over, the tokens per expert."""
    experts, topk = shape.experts, shape.topk
    return tokens * (experts * (3 * STAT + 1) + STAT + topk * (3 * IDS + STAT)) + experts * IDS


def _experts(shape: Shape, routed: int, width: int, impl: Implementation) -> float:
    """The experts' MLP over ``routed`` token copies: their permuted inputs and routing weights,
    and the MLP's internals with the weight applied to the activation (``linear_fc1``'s output,
    the activation's output, the weighted product that ``linear_fc2`` keeps; Megatron's local
    gated unit keeps its two halves apart as well)."""
    internals = (4 if impl.fused_activation else 6) if shape.glu else 3
    return routed * (shape.hidden * impl.bytes + STAT + internals * width * impl.bytes)


def _mlp(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, layer: int) -> float:
    """The MLP sublayer past its normalized input (kept by ``linear_fc1`` or the router)."""
    if not shape.is_moe(layer):
        return _mlp_internals(shape, tokens.whole, shape.ffn // layout.tp, impl)
    routed = tokens.sharded * shape.topk * layout.expert_tp  # token copies this rank's experts compute
    kept = _router(shape, tokens.sharded) + _experts(shape, routed, shape.expert_ffn // layout.expert_tp, impl)
    if shape.shared_expert_ffn:
        kept += _mlp_internals(shape, tokens.whole, shape.shared_expert_ffn // layout.tp, impl)
    return kept


def _streams(shape: Shape, tokens: Tokens, impl: Implementation, variant: str, first: bool) -> LayerActivations:
    """The norms' and residuals' share of one layer: its input, and (as ``rest``) the rest."""
    h, t, b, stats = shape.hidden, tokens.sharded, impl.bytes, shape.norm_statistics
    entry = (1 if first else 2) * h  # the layer input's width: the embedding at the first layer
    if variant == STOCK:
        return LayerActivations(t * h * b, 2 * t * STAT * stats + t * h * b)  # both norms' inputs
    if variant == "joined":
        return LayerActivations(t * entry * b, t * h * b + t * STAT * 14)  # z, statistics
    if variant == "apart":
        return LayerActivations(t * entry * b, t * 2 * h * b + 2 * t * STAT * 6)  # the MLP's packed input
    return LayerActivations(t * entry * b, t * 2 * h * b + 2 * t * h * b + 2 * 3 * t * STAT * stats)


def layer_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, variant: str,
                      layer: int) -> LayerActivations:
    """Bytes one layer keeps for one microbatch, and what its recomputation brings back at once."""
    streams = _streams(shape, tokens, impl, variant, first=layer == 0)
    t, h, b = tokens.sharded, shape.hidden, impl.bytes
    attention, mlp = _attention(shape, layout, tokens, impl), _mlp(shape, layout, tokens, impl, layer)
    masks = 2 * t * h if impl.hidden_dropout > 0 else 0  # one bool dropout mask per sublayer
    rest = streams.rest + 2 * t * h * b + attention + mlp + masks  # + what linear_qkv and linear_fc1 keep
    if layout.recompute == "full":  # only the input is kept; the rest comes back in its backward
        return LayerActivations(streams.input, 0.0, rest)
    if layout.recompute != "selective":
        return LayerActivations(streams.input, rest)
    # "layernorm" and "mlp": the MLP sublayer's input stays (the norms' checkpoint input), the
    # normalized inputs and the MLP go; the MLP comes back with its normalized input and what its
    # norms keep when they run again (the joined ops keep theirs throughout)
    stats = t * STAT * shape.norm_statistics
    kept, again = {STOCK: (t * h * b, stats), "joined": (streams.rest, 0.0), "apart": (t * 2 * h * b, t * STAT * 6),
                   "pytorch": (t * 2 * h * b, t * h * b + 3 * stats)}[variant]
    return LayerActivations(streams.input, kept + attention + masks, mlp + t * h * b + again)


def embedding_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation) -> float:
    """The first chunk's embedding: token ids (and positions), the dropout mask."""
    kept = tokens.whole * IDS * (2 if shape.learned_positions else 1)
    if impl.hidden_dropout > 0:
        kept += tokens.sharded * shape.hidden
    return kept


def head_activations(shape: Shape, layout: Layout, tokens: Tokens, impl: Implementation, variant: str) -> float:
    """The last chunk's final norm (and SiameseNorm's merge), output layer and cross entropy."""
    t, h, b = tokens.sharded, shape.hidden, impl.bytes
    kept = _norm(shape, tokens, impl, h) + t * h * b  # final norm, output layer's input
    if variant != STOCK:
        kept += t * 2 * h * b + 2 * t * STAT * shape.norm_statistics  # the packed streams into the merge
    vocab = shape.vocab // layout.tp
    kept += tokens.whole * (vocab * STAT + 1 + IDS + STAT)  # probabilities, mask, targets; the loss mask
    return kept


@dataclass(frozen=True)
class ChunkActivations:
    """What one chunk keeps per microbatch in flight, and what it holds once on top."""

    kept: float  # activations, the received input streams excluded
    received: float  # the input streams received from the previous stage (0 on the first chunk)
    sent: float  # the output streams it sends on (0 on the last chunk)
    # what a layer's recomputation adds at once in backward, its microbatch's head already freed
    working: float


def chunk_activations(chunk: Chunk, shape: Shape, layout: Layout, impl: Implementation, variant: str,
                      micro_batch: int) -> ChunkActivations:
    tokens = tokens_of(shape, layout, micro_batch)
    layers = [layer_activations(shape, layout, tokens, impl, variant, layer) for layer in chunk.layers]
    kept = sum(layer.total for layer in layers)
    working = max(layer.recomputed for layer in layers)
    received = 0.0 if chunk.first else layers[0].input
    kept -= received
    if chunk.first:
        kept += embedding_activations(shape, layout, tokens, impl)
    if chunk.last:
        head = head_activations(shape, layout, tokens, impl, variant)
        kept += head
        working = max(0.0, working - head)
    width = shape.hidden * (1 if variant == STOCK else 2)
    sent = 0.0 if chunk.last else tokens.sharded * width * impl.bytes
    return ChunkActivations(kept, received, sent, working)
