"""``megatron-siamese check``: every parallel layout against one rank (``command.py``).

``step.py`` runs one training step of a tiny GPT under a layout and reports it as global
tensors, ``sharding.py`` maps local shards to global names and back, ``compare.py`` judges
one layout against the single-rank run, ``faults.py`` plants known bugs to show the check
can fail.
"""

# The CPU matrix: every kind of parallelism, recompute, and their combinations.
DEFAULT_LAYOUTS = [
    "tp2", "tp2-sp", "pp2", "pp4", "pp2-vpp2", "dp2", "dp2-do", "full", "sel",
    "tp2-pp2-sp", "pp2-vpp2-full", "dp2-tp2", "dp2-tp2-sp-do", "tp2-pp2-vpp2-sel", "cp2",
]

SPECS = {
    "siamese": "siamese",  # SiameseNorm, Python API block spec
    "siamese-layer": "siamese-layer",  # SiameseNorm, the Megatron-LM --spec layer object
    "siamese-hybrid": "siamese-hybrid",  # the authors' hybrid variant
    "stock": "pre",  # Megatron's stock Pre-Norm layer: the control
}
