"""Token-slice execution of pipeline stages: forward slice by slice, backward in reverse.

:class:`SliceExecutor` runs one stage over the units (batch slice b, token slice t) of a
:class:`~tplib.plan.Plan`. Each unit's forward is its own autograd graph, cut at the
stage input and at the K/V context, so units can run forward and backward at different
times, in any order a schedule allows, and on different processes. The executor keeps the
K/V context of each batch slice and refuses orders that would compute something wrong:
a sequence's slices must run forward first to last and backward last to first.

With ``split_backward`` (the zero-bubble schedules) :meth:`SliceExecutor.backward` is
``B``, the input gradient only, and :meth:`SliceExecutor.weight_grad` is ``W``, the
weight gradients ``B`` deferred (:mod:`tplib.nn.wgrad`), of one unit or of every token
slice of a sequence in one product per weight.

With ``recompute="full"`` (GPipe's re-materialisation) a unit's forward keeps nothing
for backward but the unit's input (the K/V context is kept anyway, later slices read
it); its backward runs the forward again with autograd on, then backward through it.
With ``recompute="selective"`` (Korthikanti et al. 2022) only each layer's attention
core is run again, inside the backward of that layer (:mod:`tplib.nn.selective`): the
unit keeps everything else, and no attention scores.

:func:`run_pipeline_local` chains several stages in one process (all forwards, then all
backwards), which is what the exactness tests compare against the whole-sequence model.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from tplib.documents import Documents
from tplib.nn.configs import RECOMPUTE_MODES, check_recompute
from tplib.nn.context import StageContext
from tplib.nn.dropout import DropoutKey
from tplib.nn.linear import Linear
from tplib.nn.model import CausalSelfAttention, GPTStage
from tplib.nn.ring import cp_shard
from tplib.nn.wgrad import DeferredWeightGrads
from tplib.plan import Plan, Unit
from tplib.schedule.actions import WHOLE_SEQUENCE, covered_slices

__all__ = [
    "RECOMPUTE_MODES",
    "SliceExecutor",
    "check_recompute",
    "full_batch_loss",
    "run_pipeline_local",
    "unit_rows",
]


@dataclass
class _Saved:
    input: Tensor  # the unit's stage input, a leaf of its graph
    output: Tensor | None  # hidden states or scaled loss; None until recomputed
    targets: Tensor | None  # the last stage's, for recomputing the loss
    held: tuple[object, ...] = ()  # the memory meter's handles on what this keeps alive


class SliceExecutor:
    """Runs one stage over the units of a plan.

    One executor sees one stage: when the first and last stages are separate, each holds
    a copy of the tied embedding and its own part of the gradient; the caller sums them
    (:func:`run_pipeline_local` and the runtime do).

    ``loss_scale`` multiplies each unit's summed cross-entropy on the last stage; set it to
    ``1 / (global batch * seq_len)`` and the gradients are those of the mean loss.
    ``grad_scale`` multiplies the gradient backward starts from on the last stage (fp16's
    dynamic loss scale), without changing the loss returned. ``dropout``: the key of the
    iteration being trained, for the plan's first sequence (None: no dropout); each unit
    drops what the same positions of the same sequences drop in one whole-batch forward.
    ``hold``, if given, is
    told about every tensor the executor keeps alive between a unit's forward and
    backward, or between its ``B`` and ``W`` (a memory meter counts them).
    ``split_backward``: backward computes input gradients only, and
    :meth:`weight_grad` the weight gradients of the stage's products.
    """

    def __init__(
        self,
        stage: GPTStage,
        plan: Plan,
        *,
        loss_scale: float = 1.0,
        attention: str | None = None,
        dtype: torch.dtype | None = None,
        recompute: str = "none",
        hold: Callable[[Tensor], object] | None = None,
        keep_contexts: bool = True,
        split_backward: bool = False,
    ) -> None:
        check_recompute(recompute)
        self.stage = stage
        self.attention = attention
        self.dtype = dtype
        self.plan = plan
        self.loss_scale = loss_scale
        self.grad_scale = 1.0
        self.dropout: DropoutKey | None = None
        self._documents: Documents | None = None
        self._slice_documents: dict[int, Documents] = {}
        self.recompute = recompute
        self.hold = hold
        if plan.seq_len > stage.cfg.seq_len:
            raise ValueError(
                f"plan's sequence length {plan.seq_len} exceeds the model's context of "
                f"{stage.cfg.seq_len} tokens (GPTConfig.seq_len)"
            )
        # False: a batch slice's context is freed after its backward (an asynchronous
        # schedule's plan holds every iteration's batch slices, only some in flight).
        self.keep_contexts = keep_contexts
        self._contexts: dict[int, StageContext] = {}
        self.peak_contexts: list[StageContext] = []  # the most alive at once
        self._saved: dict[Unit, _Saved] = {}
        self._next_forward = [0] * plan.n_batch_slices
        self._next_backward = [len(ts) for ts in plan.token_slices]
        self.deferred: DeferredWeightGrads | None = None
        if split_backward:
            self.deferred = DeferredWeightGrads(hold)
        for module in stage.modules():
            # Set either way: a stage an earlier executor ran keeps none of its choices.
            if isinstance(module, Linear):
                module.deferred = self.deferred
            elif isinstance(module, CausalSelfAttention):
                module.recompute_core = recompute == "selective"

    @property
    def documents(self) -> Documents | None:
        """The packed rows of the batch being trained (None: unpacked)."""
        return self._documents

    @documents.setter
    def documents(self, documents: Documents | None) -> None:
        if documents is not None and (
            documents.batch != self.plan.batch or documents.seq_len != self.plan.seq_len
        ):
            raise ValueError(
                f"documents of {documents.batch} rows x {documents.seq_len} tokens for a plan "
                f"of {self.plan.batch} x {self.plan.seq_len}: they must describe its batch"
            )
        self._documents = documents
        self._slice_documents = {}

    def replan(self, plan: Plan) -> None:
        """Run the units of ``plan`` from now on: the next batch's token slicing. It keeps
        the batch split (and so the K/V contexts), and comes between iterations."""
        if plan.batch_slices != self.plan.batch_slices or plan.seq_len != self.plan.seq_len:
            raise ValueError(f"replan from {self.plan} to {plan}: only token slices may change")
        if self._saved or any(self._next_forward):
            raise RuntimeError(f"replan with units in flight ({self.pending}): finish the pass")
        self.plan = plan
        self._next_backward = [len(ts) for ts in plan.token_slices]
        self._slice_documents = {}

    def _documents_of(self, b: int) -> Documents | None:
        if self._documents is None:
            return None
        if b not in self._slice_documents:
            first, rows = self.plan.batch_offset(b), self.plan.batch_slices[b]
            self._slice_documents[b] = self._documents.rows(first, rows)
        return self._slice_documents[b]

    def context(self, b: int) -> StageContext:
        """Batch slice ``b``'s K/V context, allocated once and reused every iteration
        (unless ``keep_contexts`` is off)."""
        if b not in self._contexts:
            self._contexts[b] = self.stage.new_context(
                self.plan.batch_slices[b],
                self.plan.seq_len,
                dtype=self.dtype,
                attention=self.attention,
            )
            if len(self._contexts) > len(self.peak_contexts):
                self.peak_contexts = list(self._contexts.values())
        return self._contexts[b]

    def forward(self, unit: Unit, x: Tensor, targets: Tensor | None = None) -> Tensor:
        """Run ``unit`` forward on input ``x`` and return its output, detached.

        The output is hidden states to send on, or on the last stage the unit's scaled loss
        (then ``targets`` are required).
        """
        b, t = unit.b, unit.t
        if self._next_forward[b] != t:
            raise RuntimeError(
                f"forward of {unit} out of order: batch slice {b} expects token slice "
                f"{self._next_forward[b]} next (slices run forward first to last)"
            )
        tokens = self.stage.input_tokens(self.plan.token_slices[b][t])  # a sequence shard?
        expected = (self.plan.batch_slices[b], tokens)
        if tuple(x.shape[:2]) != expected:
            raise ValueError(f"input of {unit} has shape {tuple(x.shape)}, expected {expected}+")
        if self.stage.is_last and targets is None:
            raise ValueError("the last stage needs targets to compute the loss")
        x = x.detach().requires_grad_(x.is_floating_point())
        if self.recompute == "full":
            with torch.no_grad():
                out = self._run(unit, x, targets)
            saved = _Saved(x, None, targets)
        else:
            out = self._run(unit, x, targets)
            saved = _Saved(x, out, targets)
        if self.hold is not None:
            keep = (x, targets) if saved.output is None else (x, targets, out)
            saved.held = tuple(self.hold(k) for k in keep if k is not None)
        self._saved[unit] = saved
        self._next_forward[b] = t + 1
        if t + 1 == self.plan.n_token_slices(b):
            self._next_forward[b] = 0  # the sequence is done; next iteration starts over
        return out.detach()

    def _run(self, unit: Unit, x: Tensor, targets: Tensor | None) -> Tensor:
        b, t = unit.b, unit.t
        key = self.dropout
        if key is not None:
            key = DropoutKey(key.seed, key.first_row + self.plan.batch_offset(b))
        out = self.stage(
            x,
            start=self.plan.token_offset(b, t),
            context=self.context(b),
            targets=targets,
            dropout=key,
            documents=self._documents_of(b),
        )
        return out * self.loss_scale if self.stage.is_last else out

    def backward(self, unit: Unit, grad_output: Tensor | None = None) -> Tensor | None:
        """Run ``unit`` backward; return the gradient of its input (None on the first stage,
        whose input is token ids). Parameter gradients accumulate in ``.grad``."""
        b, t = unit.b, unit.t
        if self._next_backward[b] - 1 != t:
            raise RuntimeError(
                f"backward of {unit} out of order: batch slice {b} expects token slice "
                f"{self._next_backward[b] - 1} next (slices run backward last to first)"
            )
        saved = self._saved.pop(unit, None)
        if saved is None:
            raise RuntimeError(f"backward of {unit} before its forward")
        if not self.stage.is_last and grad_output is None:
            raise ValueError(f"backward of {unit} on a middle stage needs the output gradient")
        collect = nullcontext() if self.deferred is None else self.deferred.collecting(unit)
        with collect:
            output = saved.output
            if output is None:  # recompute: run the forward again, this time for autograd
                with torch.enable_grad(), self.context(b).recomputing():
                    output = self._run(unit, saved.input, saved.targets)
            if self.stage.is_last:
                seed = torch.full_like(output, self.grad_scale)
                torch.autograd.backward(output, seed)
            else:
                torch.autograd.backward(output, grad_output)
        self._next_backward[b] = t if t > 0 else self.plan.n_token_slices(b)
        if t == 0 and not self.keep_contexts:
            del self._contexts[b]
        return saved.input.grad

    def weight_grad(self, b: int, t: int = WHOLE_SEQUENCE) -> None:
        """``W``: add the weight gradients the backward of unit (b, t) deferred into
        ``.grad``; of every token slice of batch slice ``b`` at once (one product per
        weight) with ``t = WHOLE_SEQUENCE``."""
        if self.deferred is None:
            raise RuntimeError(
                f"weight_grad(b={b}, t={t}) on an executor without split_backward: its "
                "backwards compute the weight gradients themselves"
            )
        self.deferred.compute([Unit(b, s) for s in covered_slices(self.plan, b, t)])

    @property
    def pending(self) -> list[Unit]:
        """Units run forward but not yet backward."""
        return sorted(self._saved)


def unit_rows(plan: Plan, unit: Unit, tensor: Tensor) -> Tensor:
    """The part of a (batch, seq_len, ...) tensor that belongs to ``unit``."""
    first = plan.batch_offset(unit.b)
    lo = plan.token_offset(unit.b, unit.t)
    rows = tensor[first : first + plan.batch_slices[unit.b]]
    return rows[:, lo : lo + plan.token_slices[unit.b][unit.t]]


def run_pipeline_local(
    stages: Sequence[GPTStage],
    x: Tensor,
    plan: Plan,
    *,
    targets: Tensor | None = None,
    grad_output: Tensor | None = None,
    loss_scale: float | None = None,
    attention: str | None = None,
    recompute: str = "none",
    dropout: DropoutKey | None = None,
    split_backward: bool = False,
    dtype: torch.dtype | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """Forward and backward a batch through ``stages`` chained in this process: every unit
    forward through every stage, then every unit backward in reverse order (with
    ``split_backward``: input gradients only, then each sequence's weight gradients in
    one product per weight). ``dropout``: train with dropout, keyed for row 0 of ``x``
    (see :mod:`tplib.nn.dropout`). ``dtype``: the K/V contexts' (default the parameters';
    bfloat16 under bf16 autocast, as the runtime keeps them). ``documents``: the rows of
    ``x`` are packed (:class:`~tplib.documents.Documents`), attention stays in documents.

    ``x`` is token ids, or hidden states for a chain that starts mid-model; if it requires
    grad, its gradient is accumulated in ``x.grad``. A chain from the first stage to the
    last, on separate stages, holds the tied embedding twice (the first stage's ``wte``,
    the last stage's ``head``): each copy gets the sum of both gradients, as in the runtime,
    so both hold the whole model's gradient. A chain that ends with the model's last
    stage needs ``targets`` and returns the loss summed over units (scaled by
    ``loss_scale``, default ``1 / targets.numel()``, which makes it the mean loss). Any other
    chain needs ``grad_output``, the gradient of its output, and returns the output.
    Stages built with a :class:`~tplib.nn.ring.CPGroup` (#CP > 1) run this CP rank's
    chunks of every unit of ``x`` and ``targets``, and return its share of the loss; such a
    chain runs the whole model, token ids to loss.
    """
    plan.check_covers(x.shape[0], x.shape[1])
    for prev, nxt in itertools.pairwise(stages):
        if prev.hi != nxt.lo:
            raise ValueError(f"stages [{prev.lo}, {prev.hi}) and [{nxt.lo}, {nxt.hi}) do not chain")
    ends_model = stages[-1].is_last
    if ends_model and targets is None:
        raise ValueError("a chain that ends with the last stage needs targets")
    if not ends_model and grad_output is None:
        raise ValueError("a chain that ends mid-model needs grad_output")
    cp = stages[0].cp
    if cp is not None and not (stages[0].is_first and ends_model):
        raise ValueError(f"a chain of #CP={cp.size} ranks runs the whole model, ids to loss")
    scale = 1.0 / targets.numel() if loss_scale is None and targets is not None else loss_scale
    executors = [
        SliceExecutor(
            s,
            plan,
            loss_scale=scale or 1.0,
            attention=attention,
            recompute=recompute,
            split_backward=split_backward,
            dtype=dtype,
        )
        for s in stages
    ]
    for ex in executors:
        ex.dropout = dropout
        ex.documents = documents
    outputs: list[Tensor] = []
    for unit in plan.units():
        h = cp_shard(unit_rows(plan, unit, x), cp)
        for ex in executors:
            y = None
            if ex.stage.is_last and targets is not None:
                y = cp_shard(unit_rows(plan, unit, targets), cp)
            h = ex.forward(unit, h, y)
        outputs.append(h)
    for unit in reversed(list(plan.units())):
        grad = None if grad_output is None else unit_rows(plan, unit, grad_output)
        for ex in reversed(executors):
            grad = ex.backward(unit, grad)
        if x.requires_grad and grad is not None:
            if x.grad is None:
                x.grad = torch.zeros_like(x)
            unit_rows(plan, unit, x.grad).add_(grad)
    if split_backward:
        for b in range(plan.n_batch_slices):
            for ex in executors:
                ex.weight_grad(b)
    _sum_tied_gradients(stages)
    if ends_model:
        return torch.stack(outputs).sum()
    out = torch.empty(
        *x.shape[:2], outputs[0].shape[-1], dtype=outputs[0].dtype, device=outputs[0].device
    )
    for unit, h in zip(plan.units(), outputs, strict=True):
        unit_rows(plan, unit, out).copy_(h)
    return out


def _sum_tied_gradients(stages: Sequence[GPTStage]) -> None:
    first, last = stages[0], stages[-1]
    if first is last or not (first.is_first and last.is_last and first.cfg.tie_embeddings):
        return
    embed, head = first.wte.weight, last.head.weight
    if embed.grad is None or head.grad is None:
        return
    total = embed.grad + head.grad
    embed.grad.copy_(total)
    head.grad.copy_(total)


def full_batch_loss(
    model: GPTStage, tokens: Tensor, targets: Tensor, dropout: DropoutKey | None = None
) -> Tensor:
    """The single-device reference: mean next-token loss of whole sequences, no slicing."""
    return model(tokens, targets=targets, dropout=dropout) / targets.numel()
