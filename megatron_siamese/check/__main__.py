"""``python -m megatron_siamese.check``: the same as ``megatron-siamese check``."""

import sys

from megatron_siamese.check.command import main

sys.exit(main())
