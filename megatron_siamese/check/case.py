"""The tiny model and data the parallel check runs (plain data: the command line validates it
before any rank starts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_siamese.runtime.settings import ModelSettings


@dataclass(frozen=True)
class ModelCase(ModelSettings):
    """A tiny GPT and its data: everything but the parallel layout."""

    hidden_size: int = 32
    num_query_groups: Optional[int] = 2
    ffn_hidden_size: Optional[int] = 64
    seq_length: int = 16
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    vocab_size: int = 128
    micro_batch_size: int = 2
    num_microbatches: int = 4  # global: split over DP ranks
    seed: int = 1234
    # Adam (the distributed optimizer supports nothing else). Its first step is
    # lr * g / (|g| + eps); a large eps keeps that sensitive to the gradient's scale.
    lr: float = 0.1
    adam_eps: float = 1.0
    clip_grad: float = 1.0
    # None: Megatron's default (batched) on GPUs, off on gloo, where interleaved + batched
    # p2p gives wrong results even for the stock layer (docs/parallelism.md)
    batch_p2p_comm: Optional[bool] = None
    # PP>1: hand the schedule SiameseP2PCommunicator (the Python API way); False leaves
    # Megatron's default communicator with shape exchange (the Megatron-LM way).
    siamese_p2p: bool = True
    fault: Optional[str] = None  # a bug from check.faults planted on every rank
    # with --num-experts: MoE and dense layers alternate (every other layer from the first:
    # pipeline stages hold both), and the router's z-loss is on beside the aux loss
    moe_layer_freq: str = "2"
    moe_z_loss_coeff: Optional[float] = 1e-3
    # with --multi-latent-attention: latents and heads the size of this model (Megatron-LM's are 128s)
    kv_lora_rank: int = 16
    qk_head_dim: int = 8
    qk_pos_emb_head_dim: int = 4
    v_head_dim: int = 8
    # how Megatron runs the layers where that changes only what they keep (the plan's measured cases):
    # dropout after each sublayer and on the attention probabilities, the fused bias-activation
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bias_activation_fusion: bool = False
    # packed (THD) microbatches: each sample holds three documents (a quarter, a half and a quarter
    # of the sequence), the micro-batch's samples flattened into one row (PackedSeqParams), each
    # document attending only to itself
    packed_sequences: bool = False

    @property
    def document_lengths(self):
        """Each sample's documents under ``packed_sequences``."""
        quarter = self.seq_length // 4
        return [quarter, self.seq_length - 2 * quarter, quarter]


# The check's MoE model: 4 experts, top-2, aux loss and z-loss, Megatron's alltoall dispatcher
# (--moe-token-dispatcher-type allgather for the other), and no biases (megatron-core's experts
# cannot train them unsplit, as the single-rank run has them: runtime/divisibility.py).
MOE_CASE = ModelCase(num_moe_experts=4, add_bias_linear=False)
