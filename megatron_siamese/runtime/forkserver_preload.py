"""Imported first by the rank fork server (``launch.py``): hides the known notices in that
process before it imports torch and Megatron, so its imports print nothing a rank would not,
and selects matplotlib's file-only backend before the server imports pyplot for rank 0's
``loss.png``."""

import os

from megatron_siamese.runtime.quiet import silence_known_notices

silence_known_notices()
os.environ.setdefault("MPLBACKEND", "Agg")
