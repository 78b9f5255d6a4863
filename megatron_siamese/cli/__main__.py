"""``python -m megatron_siamese.cli``: the same as ``megatron-siamese``."""

import sys

from megatron_siamese.cli import main

sys.exit(main())
