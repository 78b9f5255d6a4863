"""Transformer Engine: whether it can be used here. Apart from the specs, so that the layer's
support check can ask without importing them (they import the layer).
"""

from __future__ import annotations

import functools
from typing import Optional


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when Transformer Engine can be used, else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401

        from megatron.core.extensions import transformer_engine  # noqa: F401
    except Exception as error:  # ImportError, or TE's own errors without a GPU
        return f"Transformer Engine is not available ({type(error).__name__}: {error})"
    return None


