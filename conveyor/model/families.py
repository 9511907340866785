"""Each architecture's network class: Llama's for every family that differs from it only in
settings (``ModelConfig``), a family's own where its layers differ (Gemma's; the mixtures of
experts')."""

from __future__ import annotations

from conveyor.model.config import ModelConfig
from conveyor.model.gemma import Gemma
from conveyor.model.model import Transformer
from conveyor.model.moe import MoETransformer

_NETWORKS: dict[str, type[Transformer]] = {"gemma2": Gemma, "gemma3": Gemma}


def network(config: ModelConfig) -> type[Transformer]:
    """The class to build ``config``'s network with (on the meta device; see ``Transformer``)."""
    if config.moe is not None:
        return MoETransformer
    return _NETWORKS.get(config.architecture, Transformer)
