"""``megatron-siamese check``: every parallel layout against one rank (``command.py``).

``step.py`` runs one training step of a tiny GPT under a layout and reports it as global
tensors, ``sharding.py`` maps local shards to global names and back, ``compare.py`` judges
one layout against the single-rank run, ``faults.py`` plants known bugs to show the check
can fail.
"""

# The CPU matrix: every kind of parallelism, recompute, and their combinations; context
# parallelism alone and with TP + SP, PP and the distributed optimizer (on CPU through the local
# context-parallel attention, core_attention.py); fully sharded data parallelism both ways (torch
# FSDP2; Megatron-FSDP sharding everything, and optimizer state and gradients only), with TP + SP
# and with full recompute.
DEFAULT_LAYOUTS = [
    "tp2", "tp2-sp", "pp2", "pp4", "pp2-vpp2", "dp2", "dp2-do", "full", "sel",
    "tp2-pp2-sp", "pp2-vpp2-full", "dp2-tp2", "dp2-tp2-sp-do", "tp2-pp2-vpp2-sel",
    "cp2", "tp2-cp2-sp", "pp2-cp2", "dp2-cp2-do",
    "dp2-fsdp2", "tp2-dp2-sp-fsdp2", "dp2-fsdp2-full", "dp2-mfsdp3", "tp2-dp2-sp-mfsdp3", "dp2-mfsdp2",
]

# The MoE matrix (models with --num-experts): experts split over EP ranks alone, with TP + SP
# (experts split over the same TP ranks, or unsplit: etp1), with expert TP apart from TP (etp2),
# over PP (1F1B, interleaved), with the distributed optimizer (its expert state sharded over
# the expert-data-parallel group: dp4-ep2-do), with recompute; experts not EP-split; and fully
# sharded (torch FSDP2 refuses EP: experts unsplit; Megatron-FSDP with each expert on two DP ranks);
# the experts split over the context-parallel ranks (they route each rank's own tokens).
MOE_LAYOUTS = [
    "ep2", "ep4", "tp2-ep2-sp", "tp2-ep2-etp1-sp", "ep2-etp2", "pp2-ep2", "pp2-vpp2-ep2",
    "ep2-do", "dp4-ep2-do", "ep2-full", "tp2-sp", "pp2-vpp2-full", "dp2-fsdp2", "dp4-ep2-mfsdp3", "cp2-ep2",
]

SPECS = {
    "siamese": "siamese",  # SiameseNorm, Python API block spec
    "siamese-layer": "siamese-layer",  # SiameseNorm, the Megatron-LM --spec layer object
    "siamese-hybrid": "siamese-hybrid",  # the authors' hybrid variant
    "post": "post",  # the single-stream baselines on Megatron's TransformerLayer
    "hybridnorm": "hybridnorm",
    "mixln": "mixln",
    "stock": "pre",  # Megatron's stock Pre-Norm layer: the control
}
