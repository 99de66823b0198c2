"""0.2.x's per-layer selective activation checkpointing, on 0.3.x.

torchtitan 0.3 checkpoints selectively per op only. 0.2.x's
``selective_ac_option = N`` checkpoints every Nth transformer block whole
(every block for 0). ``LayerAC`` does that with 0.3's own ``FullAC`` wrapper,
so a train config keeps its meaning on both eras. Imported on 0.3.x only
(``depend`` records pin the upstream classes it builds on).

Runs are deterministic, but with N > 1 not bit-identical to the same run
without AC: upstream's ``init_states`` visits wrapped blocks after the
others, so the initial weights draw from the RNG in another order.
"""

from dataclasses import dataclass

from torch import nn
from torchtitan.distributed.activation_checkpoint import FullAC


class LayerAC(FullAC):
    """Every ``every``-th transformer block of a model part checkpointed whole."""

    @dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        every: int = 2
        """Checkpoint blocks every, 2 * every, ...; 0: every block."""

    def __init__(self, config: "LayerAC.Config", dump_folder: str = ""):
        super().__init__(config, dump_folder)
        self._blocks = 0

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None):
        self._blocks += 1
        every = self.config.every  # pyrefly: ignore[missing-attribute]
        if every and self._blocks % every:
            return module
        return super()._wrap_block(module, base_fqn=base_fqn)
