"""HybridModel layer patterns, read as Megatron-Core reads them (plain text, no torch).

``*-M*|*-M*/*-`` is one symbol per layer (``*`` attention, ``-`` MLP, ``M`` Mamba, ...), ``|`` between
pipeline segments, and after ``/`` the multi-token-prediction layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

PIPE = "|"
MTP_SEPARATOR = "/"
GPT_BLOCK = "*-"  # one GPT block: attention, then MLP


@dataclass(frozen=True)
class HybridPattern:
    text: str

    @property
    def main(self) -> str:
        """The decoder's part: its symbols with any '|' boundaries (the MTP part cut off)."""
        return self.text.split(MTP_SEPARATOR)[0]

    @property
    def mtp(self) -> Optional[str]:
        """What follows the first '/', or None without one."""
        return self.text.partition(MTP_SEPARATOR)[2] if MTP_SEPARATOR in self.text else None

    @property
    def layers(self) -> str:
        """The decoder's layer symbols, one per layer, without boundaries."""
        return self.main.replace(PIPE, "")

    @property
    def segments(self) -> List[str]:
        """The decoder's pipeline segments as written (one without '|')."""
        return self.main.split(PIPE)

    @property
    def has_boundaries(self) -> bool:
        return PIPE in self.main

    def staged(self, stages: int) -> str:
        """The pattern cut into ``stages`` equal pipeline segments (boundaries the user wrote kept as they are)."""
        if self.has_boundaries or stages == 1:
            return self.text
        layers = self.layers
        if len(layers) % stages:
            raise ValueError(
                f"the hybrid pattern {self.text!r} has {len(layers)} layers, which do not split evenly into "
                f"{stages} pipeline stages; write the stage boundaries into the pattern with '|'"
            )
        size = len(layers) // stages
        main = PIPE.join(layers[i:i + size] for i in range(0, len(layers), size))
        return main if self.mtp is None else main + MTP_SEPARATOR + self.mtp


def hybrid_pattern(settings) -> HybridPattern:
    """The HybridModel pattern of ``settings`` (a ModelSettings): its own, or one ``*-`` per GPT layer."""
    return HybridPattern(settings.hybrid_layer_pattern or GPT_BLOCK * settings.num_layers)


def num_layers(settings) -> int:
    """Megatron's num_layers: GPT blocks, or HybridModel layers (one per pattern symbol)."""
    return len(hybrid_pattern(settings).layers) if settings.model == "hybrid" else settings.num_layers
