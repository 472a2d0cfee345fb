"""The run's parallel layout as one frozen value: sizes of every dimension and where its ranks sit.

`megapkl plan` sizes memory with it, the SGLang placement puts servers beside the trainer ranks
with it, the checkpoint manifest records it and the engine context carries it: one shape, built
once from the `parallel` section (`Layout.of`).

Global ranks follow megatron-core's default order "tp-cp-ep-dp-pp": TP fastest, then CP, then
DP, then PP, so data-parallel replica `d` is every rank whose DP coordinate is `d` (EP folds into
DP for the dense part and does not move a rank). Nodes take `per_node` consecutive ranks
(LOCAL_WORLD_SIZE: launchers lay ranks out block by block).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sp: bool = False
    per_node: int = 1  # trainer ranks (= GPUs) per node

    @classmethod
    def of(cls, parallel: Any, world: int | None = None, per_node: int = 1) -> "Layout":
        """From the `parallel` section. With `world`, the ranks started decide DP (world / the
        model-parallel size, as the process groups have it: `parallel.data` is what a launcher
        starts); without one, `parallel.data` does, an "auto" one counting as 1."""
        mp = parallel.tensor * parallel.pipeline * parallel.context
        if world is not None:
            dp = max(1, world // mp)
        elif isinstance(parallel.data, int):
            dp = parallel.data
        else:
            dp = 1
        return cls(tp=parallel.tensor, pp=parallel.pipeline, cp=parallel.context,
                   ep=parallel.expert, dp=dp, sp=parallel.sequence_parallel, per_node=per_node)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        """What a checkpoint's manifest records of it (the node width is the job's, not the
        model's: a checkpoint resumes on any number of nodes)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "ep": self.ep}

    def replica_ranks(self, d: int) -> list[int]:
        return [t + self.tp * (c + self.cp * (d + self.dp * p))
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def leader(self, d: int) -> int:
        return self.tp * self.cp * d

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def replica_nodes(self, d: int) -> list[int]:
        """The nodes replica `d` trains on, in allocation order."""
        return sorted({self.node_of(r) for r in self.replica_ranks(d)})

    def first_rank_on(self, d: int, node: int) -> int:
        """Replica `d`'s lowest global rank on `node` (the owner of the fleet there)."""
        return min(r for r in self.replica_ranks(d) if self.node_of(r) == node)
