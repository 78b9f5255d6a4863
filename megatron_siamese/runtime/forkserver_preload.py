"""Imported first by the rank fork server (``launch.py``): hides the known notices in that
process before it imports torch and Megatron, so its imports print nothing a rank would not."""

from megatron_siamese.runtime.quiet import silence_known_notices

silence_known_notices()
