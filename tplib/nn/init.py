"""GPT-2's initialisation, drawn per parameter from a generator seeded by its name.

Any stage therefore holds exactly the values the same layers have in the whole model
(stage and whole-model parameter names agree, :mod:`tplib.nn.model`), and a partitioned
stage holds exactly its shard of them (vocabulary padding is zero). Residual projections
get std / sqrt(2 * n_layer), as in GPT-2.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from tplib.nn.configs import GPTConfig
from tplib.nn.oppart import OpGroup, shard_spec, take_shard

__all__ = ["init_parameters"]


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_parameters(
    params: Iterable[tuple[str, nn.Parameter]],
    cfg: GPTConfig,
    op: OpGroup | None,
    whole_shapes: Mapping[str, torch.Size],
    seed: int = 0,
) -> None:
    """Initialise named ``params`` of a stage of ``cfg``; with an ``op`` group each is the
    rank's shard of a whole parameter of ``whole_shapes[name]``. Parameters on the
    ``meta`` device are left alone."""
    for name, param in params:
        if param.device.type == "meta":
            return
        shape = whole_shapes.get(name, param.shape)
        if name == "head.weight" and cfg.tie_embeddings:
            name = "wte.weight"  # a last stage's copy of the shared embedding
        leaf = name.rsplit(".", 1)[-1]
        if (name.startswith("blocks.") and ".ln_" in name) or name.startswith("ln_f."):
            param.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            param.zero_()
        else:
            std = cfg.init_std
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                std /= math.sqrt(2 * cfg.n_layer)
            g = torch.Generator().manual_seed(_seed_for(seed, name))
            values = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            if op is not None:
                values = take_shard(values, shard_spec(name), op.rank, op.size)
            param.copy_(values)
