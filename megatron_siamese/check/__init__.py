"""``megatron-siamese check``: every parallel layout against one rank (``command.py``).

``step.py`` runs one training step of a tiny GPT under a layout and reports it as global
tensors, ``sharding.py`` maps local shards to global names and back, ``compare.py`` judges
one layout against the single-rank run, ``faults.py`` plants known bugs to show the check
can fail.
"""
