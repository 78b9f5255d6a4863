"""The mixture-of-experts MLP sublayer in plain PyTorch: the oracle for Megatron's ``MoELayer``
(``TopKRouter``, ``SequentialMLP`` experts, ``SharedExpertMLP``) in a SiameseNorm layer.

It is a sublayer like the dense MLP: it gets the ``h``-wide sublayer input
``InputNorm(PostNorm(x) + PreNorm(y))`` and returns ``z``; the two streams, the norms and the
residual update are the layer's (reference/functional.py). The router sees exactly what the
experts see, never the packed streams. For the T tokens of a microbatch and E experts:

    logits = x W^T (+ b)                        # [T, E], in moe_router_dtype if set
    post-softmax (Megatron's default): p = softmax over each token's k largest logits
    pre-softmax: p = the k largest of softmax(logits) (top-1 needs it)
    z_t = sum_{e in topk(t)} p_te * s * Expert_e(x_t)   (s: moe_router_topk_scaling_factor, else 1)
          + SharedExpert(x_t) [* sigmoid(g . x_t) with moe_shared_expert_gate]

Training adds two router losses that change no forward value (the LM loss does not contain
them) but that Megatron's backward differentiates: ``MoEAuxLossAutoScaler`` gives each the
main loss's gradient scale, so for one microbatch the objective is ``CE.mean() + aux + z``:

    aux = coeff * E / (k T^2) * sum_e n_e * sum_t softmax(logits)_te
          (n_e: tokens whose top-k holds e; switch_load_balancing_loss_func; for
          seq_aux_loss the same per sequence, averaged over the batch)
    z   = z_coeff * mean_t logsumexp(logits_t)^2            (z_loss_func)
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from reference_model.mlp import ReferenceMLP

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}

# Megatron MoE settings whose math the reference does not have: any of them set (not None /
# False / the default named here) and from_megatron refuses rather than compute something else
_UNMODELLED = {
    "moe_router_score_function": "softmax",
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": None,
    "moe_router_force_load_balancing": None,
    "moe_router_force_biased": None,
    "moe_enable_routing_replay": None,
    "moe_router_padding_for_quantization": None,
    "moe_router_padding_for_fp8": None,
    "moe_expert_capacity_factor": None,
    "moe_expert_rank_capacity_factor": None,
    "moe_input_jitter_eps": None,
    "moe_apply_probs_on_input": None,
    "moe_latent_size": None,
    "moe_mlp_glu_interleave_size": None,
    "moe_shared_expert_glu_interleave_size": None,
    "calculate_per_token_loss": None,  # rescales the router losses by the token count
}


def unmodelled_settings(config) -> List[str]:
    """The MoE settings of a Megatron TransformerConfig (duck-typed) the reference cannot compute."""
    found = [f"{name}={getattr(config, name)!r}" for name, default in _UNMODELLED.items()
             if getattr(config, name, None) not in (None, False, default)]
    if not isinstance(config.moe_router_load_balancing_type, str):
        found.append(f"moe_router_load_balancing_type={config.moe_router_load_balancing_type!r} (a list)")
    elif config.moe_router_load_balancing_type not in LOAD_BALANCING:
        found.append(f"moe_router_load_balancing_type={config.moe_router_load_balancing_type!r}")
    return found


def moe_layers(num_layers: int, moe_layer_freq: Union[int, Sequence[int]]) -> List[bool]:
    """Which layers are MoE layers: every N-th from the first, or one 0/1 per layer."""
    if isinstance(moe_layer_freq, int):
        return [layer % moe_layer_freq == 0 for layer in range(num_layers)]
    if len(moe_layer_freq) != num_layers:
        raise ValueError(f"moe_layer_freq lists {len(moe_layer_freq)} layers, num_layers is {num_layers}")
    return [bool(moe) for moe in moe_layer_freq]


def route(logits: Tensor, topk: int, pre_softmax: bool, scaling_factor: Optional[float]) -> Tuple[Tensor, Tensor]:
    """(probs [T, k], experts [T, k]) of router logits [T, E]; probs in fp32 (fp64 for doubles)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    if pre_softmax:
        probs, experts = logits.to(compute).softmax(dim=-1).topk(topk, dim=-1)
    else:
        top, experts = logits.topk(topk, dim=-1)
        probs = top.to(compute).softmax(dim=-1)
    if scaling_factor:
        probs = probs * scaling_factor
    return probs.to(logits.dtype), experts


def load_balancing_loss(logits: Tensor, topk: int, coeff: float) -> Tensor:
    """The Switch load-balancing loss of one group of tokens' router logits [T, E]."""
    tokens, num_experts = logits.shape
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=-1).indices, 1.0)
    tokens_per_expert = chosen.sum(dim=0)  # counts: no gradient flows through the choice
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * tokens * tokens))


def z_loss(logits: Tensor, coeff: float) -> Tensor:
    """ST-MoE's router z-loss of router logits [T, E]."""
    return logits.logsumexp(dim=-1).square().mean() * coeff


class ReferenceRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_moe_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_moe_experts)) if config.add_bias_linear else None

    def forward(self, x: Tensor) -> Tensor:
        """Router logits [..., E] of x [..., h]."""
        dtype = ROUTER_DTYPES[self.config.moe_router_dtype] or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


class ReferenceExperts(nn.Module):
    """A loop over the experts, each a dense MLP of width ``moe_ffn_hidden_size``."""

    def __init__(self, config):
        super().__init__()
        self.local_experts = nn.ModuleList(
            ReferenceMLP(config, config.moe_ffn_hidden_size) for _ in range(config.num_moe_experts)
        )

    def forward(self, tokens: Tensor, probs: Tensor, experts: Tensor) -> Tensor:
        """sum over each token's chosen experts of prob * Expert(token) (its fc2 bias included)."""
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.local_experts):
            rows, slot = (experts == index).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            output, bias = expert(tokens[rows])
            if bias is not None:
                output = output + bias
            out = out.index_add(0, rows, output * probs[rows, slot, None].to(output.dtype))
        return out


class ReferenceSharedExpert(ReferenceMLP):
    """The dense MLP every token also goes through, optionally gated by sigmoid(g . x)."""

    def __init__(self, config):
        if config.add_bias_linear:
            raise ValueError("Megatron's shared experts have no biases: set add_bias_linear=False")
        super().__init__(config, config.moe_shared_expert_intermediate_size)
        self.gate_weight = nn.Parameter(torch.zeros(1, config.hidden_size)) if config.moe_shared_expert_gate else None

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        output, _ = super().forward(x)
        if self.gate_weight is not None:
            output = output * torch.sigmoid(nn.functional.linear(x, self.gate_weight))
        return output


class ReferenceMoE(nn.Module):
    """The MoE sublayer: router, experts, optional shared expert. ``router_loss`` holds the last
    training forward's aux + z loss (None when not training or neither is on)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.router = ReferenceRouter(config)
        self.experts = ReferenceExperts(config)
        self.shared_experts = ReferenceSharedExpert(config) if config.moe_shared_expert_intermediate_size else None
        self.router_loss: Optional[Tensor] = None

    def forward(self, x: Tensor):
        """x [b, s, h] -> (output [b, s, h], None): the experts add their biases themselves."""
        cfg = self.config
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        probs, experts = route(logits, cfg.moe_router_topk, cfg.moe_router_pre_softmax,
                               cfg.moe_router_topk_scaling_factor)
        self.router_loss = self.losses(logits.view(*x.shape[:-1], -1)) if self.training else None
        out = self.experts(tokens, probs, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view_as(x), None

    def losses(self, logits: Tensor) -> Optional[Tensor]:
        """aux + z loss of router logits [b, s, E]."""
        cfg = self.config
        terms = []
        if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type == "aux_loss":
            terms.append(load_balancing_loss(logits.flatten(0, 1), cfg.moe_router_topk, cfg.moe_aux_loss_coeff))
        if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type == "seq_aux_loss":
            per_sequence = [load_balancing_loss(seq, cfg.moe_router_topk, cfg.moe_aux_loss_coeff) for seq in logits]
            terms.append(torch.stack(per_sequence).mean())
        if cfg.moe_z_loss_coeff is not None:
            terms.append(z_loss(logits.flatten(0, 1), cfg.moe_z_loss_coeff))
        return sum(terms) if terms else None
