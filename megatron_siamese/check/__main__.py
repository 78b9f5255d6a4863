"""``python -m megatron_siamese.check``: the same as ``megatron-siamese check``."""

import sys

from megatron_siamese.cli import main

sys.exit(main(["check", *sys.argv[1:]]))
