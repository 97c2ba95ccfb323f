"""Weight versions of one stage: what an asynchronous schedule's ``v`` refers to.

Version ``v`` of a stage is its weights after ``v`` updates. The optimizer steps one set
of parameters in place, the *home* weights, which always hold the latest version.
Compute never uses the home parameters directly: each version the schedule names gets
its own ``nn.Parameter`` objects, installed in the module before the forward or backward
that uses it. They share the home storage while their version is the latest, so a
version costs nothing until the optimizer is about to overwrite it. If a later action
still needs it then (a unit in flight: PipeDream's weight stashing, 2BW's shadow
version), the home weights move to a copy and the version keeps the storage
(:meth:`WeightVersions.before_step`): whatever autograd saved of it, the parameter
objects or views of their storage, still reads the weights the forward read.

Moving storage goes through ``.data``, which leaves the objects (and the version
counters autograd checks) untouched. Every version's ``.grad`` is the home gradient, so
all versions accumulate into the one buffer the all-reduce and the optimizer read. (fp16,
whose gradients accumulate in each home parameter's ``main_grad`` instead, is refused
with these schedules by :class:`~tplib.runtime.RunConfig`: a skipped step needs a flush.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tplib.schedule import NO_VERSION, Action

__all__ = ["WeightVersions"]


def _last_uses(actions: Sequence[Action]) -> dict[int, int]:
    """Each version's last use (an index into ``actions``)."""
    out: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.v != NO_VERSION:
            out[a.v] = i
    return out


class WeightVersions:
    """The versions of ``module``'s parameters one stage's schedule ``actions`` needs."""

    def __init__(self, module: nn.Module, actions: Sequence[Action]) -> None:
        self.module = module
        self.home = list(module.parameters())  # deduplicated: the tied embedding once
        index = {id(p): i for i, p in enumerate(self.home)}
        # Every slot a parameter sits in (a tied weight sits in two), to install versions.
        self.slots = [
            (mod, name, index[id(p)])
            for mod in module.modules()
            for name, p in mod._parameters.items()
            if p is not None
        ]
        self.last_use = _last_uses(actions)
        self.latest = 0
        self.versions: dict[int, list[nn.Parameter]] = {0: self._alias()}
        self.installed = -1
        self.most_held = 1
        self.stash_bytes_peak = 0

    def _alias(self) -> list[nn.Parameter]:
        out = []
        for h in self.home:
            p = nn.Parameter(torch.empty(0, dtype=h.dtype, device=h.device), h.requires_grad)
            p.data = h.data  # shares the storage, not the version counter
            p.grad = h.grad
            out.append(p)
        return out

    def use(self, v: int) -> None:
        """Install version ``v`` for the forward or backward about to run."""
        if v not in self.versions:
            raise RuntimeError(
                f"weight version {v} is not held (held: {sorted(self.versions)}, latest "
                f"{self.latest}): the schedule uses a version the stage never made or "
                "already dropped"
            )
        if self.installed != v:
            params = self.versions[v]
            for mod, name, i in self.slots:
                mod._parameters[name] = params[i]
            self.installed = v

    def done(self, position: int) -> list[nn.Parameter]:
        """The action at ``position`` has run: drop the stashed versions nothing later
        uses; return their parameters (their storage is freed with them)."""
        dropped: list[nn.Parameter] = []
        for v in [v for v in self.versions if v < self.latest]:
            if self.last_use.get(v, -1) <= position:
                dropped += self.versions.pop(v)
                if self.installed == v:
                    self.installed = -1
        return dropped

    def before_step(self, position: int) -> bool:
        """The update at ``position`` is about to overwrite the home weights: if a later
        action uses the latest version, stash it (the home weights move to a copy);
        put the home parameters back in the module. Returns whether it stashed."""
        keep = self.last_use.get(self.latest, -1) > position
        if keep:
            for h in self.home:
                h.data = h.data.clone()
        else:
            del self.versions[self.latest]
        for mod, name, i in self.slots:
            mod._parameters[name] = self.home[i]
        self.installed = -1
        held = len(self.versions) + 1  # the stashed ones and the version being made
        self.most_held = max(self.most_held, held)
        stashed = sum(p.numel() * p.element_size() for ps in self.versions.values() for p in ps)
        self.stash_bytes_peak = max(self.stash_bytes_peak, stashed)
        return keep

    def after_step(self) -> None:
        """The update made a new latest version in the home weights."""
        self.latest += 1
        self.versions[self.latest] = self._alias()

    def restore(self) -> None:
        """Put the home parameters back in the module (at the end of the run)."""
        for mod, name, i in self.slots:
            mod._parameters[name] = self.home[i]
        self.installed = -1

    def __repr__(self) -> str:
        return f"WeightVersions(latest={self.latest}, held={sorted(self.versions)})"
