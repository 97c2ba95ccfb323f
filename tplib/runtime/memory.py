"""Measured memory of a stage: what the runtime reports as each pipeline stage's peak.

A stage's memory has a static part, which lives for the whole run, and activations, which
grow with every unit run forward and shrink with every unit run backward.

- On CUDA the caching allocator knows the peak: :func:`cuda_peak` and
  :func:`reset_cuda_peak` wrap ``torch.cuda.max_memory_allocated`` and its reset, and
  :meth:`StageMemory.allocator` splits that peak into the static part and the rest.
- On CPU nothing tracks allocations, so the activations are counted. A
  :class:`MemoryMeter` installs ``torch.autograd.graph.saved_tensors_hooks`` while it is
  entered and counts what autograd saves for backward, plus the tensors the executor holds
  for its pending units (:meth:`MemoryMeter.hold`: a unit's input and output). The static
  part comes from tensor sizes (:func:`static_bytes`), and :meth:`StageMemory.counted`
  adds the meter's peak.

What the meter counts, precisely:

- Bytes of *untyped storages*, not of tensors: a saved tensor counts its whole storage
  (``storage.nbytes()``), however small a view of it was saved, because the view keeps all
  of it alive. A storage counts once however many saved tensors, views or held tensors
  refer to it (q, k and v are three views of one QKV output: one storage). Storages are
  keyed by ``(device, data_ptr)``; a counted storage is kept alive by the meter's handle,
  so its address cannot be reused while it is counted.
- From the moment autograd saves a tensor (or :meth:`~MemoryMeter.hold` is called) until
  autograd frees the saved variable (``backward()`` without ``retain_graph`` frees it, and
  so does dropping the graph unrun) or the holder drops its handle.
- Never: storages registered with :meth:`~MemoryMeter.exclude` (the caller excludes
  parameters and the K/V context buffers, which are counted as static; a view of a
  parameter such as ``weight.t()`` shares its storage and is excluded with it), and
  storages with no data (``data_ptr`` 0: empty or ``meta`` tensors).

What it does not count:

- Tensors that are alive but not saved: temporaries between two ops of one expression,
  the gradients flowing through backward, and tensors a custom ``autograd.Function`` keeps
  as ``ctx`` attributes instead of passing them to ``save_for_backward``.
- Buffers inside one kernel (workspace, scratch), allocator rounding, caching and
  fragmentation, and anything saved while no meter is entered.
- Non-strided tensors (sparse, nested), which have no single storage: they count 0.

It is single-threaded bookkeeping: the counts change from pack hooks during forward and
from finalizers when autograd frees a graph, all under the GIL and never concurrently in
the executor, which runs each backward to completion before the next action.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import Tensor, nn

from tplib.nn.bytecount import StorageKey as _Key
from tplib.nn.bytecount import gradient_bytes, parameter_bytes, storage_bytes, storage_key

__all__ = ["Held", "MemoryMeter", "StageMemory", "cuda_peak", "reset_cuda_peak"]


class Held:
    """A meter's count of one storage, released when this handle is dropped or released.

    The meter returns one from every pack hook (autograd keeps it as the saved variable,
    and frees it with the graph) and from :meth:`MemoryMeter.hold`. It keeps ``tensor``
    alive, so the storage it counts cannot be freed and its address reused while counted.
    """

    __slots__ = ("_key", "_meter", "tensor")

    def __init__(self, meter: MemoryMeter | None, key: _Key | None, tensor: Tensor) -> None:
        self._meter = meter
        self._key = key
        self.tensor = tensor

    def release(self) -> None:
        """Stop counting; idempotent. Dropping the handle does the same."""
        meter, key = self._meter, self._key
        self._meter = self._key = None
        if meter is not None and key is not None:
            meter._drop(key)

    def __del__(self) -> None:
        self.release()


class MemoryMeter:
    """Counts the storages that autograd saves and the executor holds (see the module
    docstring for exactly what counts).

    ``with meter:`` installs the saved-tensor hooks for the block only, and may be entered
    any number of times (once per action) and nested; counts persist between blocks, since
    graphs built in one block are freed in a later one.
    """

    def __init__(self) -> None:
        self.current = 0  # bytes counted now
        self.peak = 0  # most bytes counted at once since construction or reset_peak()
        self._refs: dict[_Key, list[int]] = {}  # key -> [references, nbytes]
        # Excluded storages are kept alive here: their addresses must not be reused by an
        # activation, which would then be wrongly excluded. They are parameters and context
        # buffers, alive for the whole run anyway.
        self._excluded: dict[_Key, torch.UntypedStorage] = {}
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []

    def __enter__(self) -> MemoryMeter:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.pop().__exit__(exc_type, exc, tb)

    @property
    def active(self) -> bool:
        """Whether the hooks are installed (inside a ``with meter:`` block)."""
        return bool(self._hooks)

    @property
    def n_storages(self) -> int:
        """How many distinct storages are counted now."""
        return len(self._refs)

    def include(self, tensors: Iterable[Tensor]) -> None:
        """Undo :meth:`exclude` for ``tensors`` (their storages may then be freed)."""
        for t in tensors:
            if t.layout == torch.strided:
                storage = t.untyped_storage()
                self._excluded.pop((storage.device, storage.data_ptr()), None)

    def exclude(self, tensors: Iterable[Tensor]) -> None:
        """Never count the storages of ``tensors`` (nor of any view of them).

        Exclude before the forwards concerned: a storage already counted stays counted
        until its references are released.
        """
        for t in tensors:
            if t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() != 0:
                self._excluded[(storage.device, storage.data_ptr())] = storage

    def hold(self, tensor: Tensor) -> Held:
        """Count ``tensor``'s storage until the returned handle is released or dropped."""
        return Held(self, self._add(tensor), tensor)

    def reset_peak(self) -> None:
        """Start a new peak from what is counted now."""
        self.peak = self.current

    def _add(self, tensor: Tensor) -> _Key | None:
        found = storage_key(tensor)
        if found is None or found[0] in self._excluded:
            return None
        key, nbytes = found
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return key

    def _drop(self, key: _Key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.current -= entry[1]

    def _pack(self, tensor: Tensor) -> Held:
        # Detached: a handle holding an op's own output would hold its grad_fn, whose saved
        # variable holds the handle, a cycle through C++ that the garbage collector cannot
        # see, and the graph would never be freed.
        return Held(self, self._add(tensor), tensor.detach())

    @staticmethod
    def _unpack(held: Held) -> Tensor:
        return held.tensor


def _require_cuda(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the allocator's peak exists on CUDA only, not on {device}")
    return device


def cuda_peak(device: torch.device | str) -> int:
    """Peak bytes allocated on a CUDA ``device`` since the last :func:`reset_cuda_peak`."""
    return int(torch.cuda.max_memory_allocated(_require_cuda(device)))


def reset_cuda_peak(device: torch.device | str) -> None:
    """Start a new allocator peak on a CUDA ``device`` from what is allocated now."""
    torch.cuda.reset_peak_memory_stats(_require_cuda(device))


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage: the static parts and the activations' peak.

    ``source`` says where the peak comes from: ``"counted"`` (a :class:`MemoryMeter`, on
    CPU) or ``"allocator"`` (CUDA's peak minus the static parts, so it also includes what
    the meter leaves out: kernel workspace, gradients in flight, allocator rounding).
    ``total`` adds the parts as if all were alive at once: the gradients and optimizer
    state exist only from the first backward and step on, so before then it is an upper
    bound.
    """

    params: int
    grads: int
    optimizer: int
    contexts: int
    activations_peak: int
    source: str
    stashed: int = 0  # older weight versions an asynchronous schedule kept, at their peak

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.contexts
            + self.activations_peak
            + self.stashed
        )

    @classmethod
    def counted(
        cls,
        module: nn.Module,
        meter: MemoryMeter,
        *,
        optimizer_state_bytes: int = 0,
        contexts: Iterable[Tensor] = (),
        stashed: int = 0,
    ) -> StageMemory:
        """The static parts of ``module`` now, with ``meter``'s peak as activations."""
        return cls(
            params=parameter_bytes(module),
            grads=gradient_bytes(module),
            optimizer=optimizer_state_bytes,
            contexts=storage_bytes(contexts),
            activations_peak=meter.peak,
            source="counted",
            stashed=stashed,
        )

    @classmethod
    def allocator(
        cls,
        module: nn.Module,
        device: torch.device | str,
        *,
        optimizer_state_bytes: int = 0,
        contexts: Iterable[Tensor] = (),
        stashed: int = 0,
    ) -> StageMemory:
        """The static parts of ``module`` now, with the rest of CUDA's peak as activations."""
        peak = cuda_peak(device)
        params, grads = parameter_bytes(module), gradient_bytes(module)
        context = storage_bytes(contexts)
        rest = peak - (params + grads + optimizer_state_bytes + context + stashed)
        return cls(
            params=params,
            grads=grads,
            optimizer=optimizer_state_bytes,
            contexts=context,
            activations_peak=max(0, rest),
            source="allocator",
            stashed=stashed,
        )

    @classmethod
    def measure(
        cls,
        module: nn.Module,
        device: torch.device,
        meter: MemoryMeter | None,
        *,
        optimizer_state_bytes: int = 0,
        contexts: Iterable[Tensor] = (),
        stashed: int = 0,
    ) -> StageMemory | None:
        """What a rank measured: CUDA's allocator on a GPU, ``meter`` on CPU (None when
        the CPU run did not count)."""
        if device.type == "cuda":
            return cls.allocator(
                module,
                device,
                optimizer_state_bytes=optimizer_state_bytes,
                contexts=contexts,
                stashed=stashed,
            )
        if meter is None:
            return None
        return cls.counted(
            module,
            meter,
            optimizer_state_bytes=optimizer_state_bytes,
            contexts=contexts,
            stashed=stashed,
        )
