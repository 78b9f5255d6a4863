"""``megatron-siamese check``: every parallel layout against one rank (``command.py``); ``step.py``
runs a layout's step, ``sharding.py`` maps shards to global names, ``compare.py`` judges, ``faults.py``
plants known bugs to show the check can fail.
"""

# The CPU matrix: every kind of parallelism and recompute, and their combinations (CP through the local
# context-parallel attention, core_attention.py; FSDP both ways)
DEFAULT_LAYOUTS = [
    "tp2", "tp2-sp", "pp2", "pp4", "pp2-vpp2", "dp2", "dp2-do", "full", "sel",
    "tp2-pp2-sp", "pp2-vpp2-full", "dp2-tp2", "dp2-tp2-sp-do", "tp2-pp2-vpp2-sel",
    "cp2", "tp2-cp2-sp", "pp2-cp2", "dp2-cp2-do",
    "dp2-fsdp2", "tp2-dp2-sp-fsdp2", "dp2-fsdp2-full", "dp2-mfsdp3", "tp2-dp2-sp-mfsdp3", "dp2-mfsdp2",
]

# The MoE matrix (models with --num-experts): EP alone and with TP + SP, expert TP, PP, the distributed
# optimizer, recompute, FSDP (FSDP2 refuses EP: experts unsplit) and CP (docs/parallelism.md)
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
