"""A tplib schedule exported to torch's action CSV and run by torch's pipeline runtime
(tplib.runtime.torchpipe) computes what tplib's runtime computes on the same schedule:
the loss and every gradient (fp32, within 1e-5 of the largest), on 2 gloo ranks with the
tiny model. gpipe and 1f1b; interleaved-1f1b with two chunks per rank, whose ranks
exchange activations and gradients over one untagged FIFO each way (the compute_comms
export's receive order); zbv, whose W torch computes through autograd."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tplib.plan import Plan
from tplib.runtime import Data, Hooks, LocalPool, Parallelism, RunConfig, Timing
from tplib.runtime.torchpipe import run_torch
from tplib.schedule import make_schedule

from .conftest import assert_scaled_close

SEQ_LEN, BATCH = 16, 4


def _run(schedule: str, n_chunks: int = 1, fields: dict[str, object] | None = None) -> RunConfig:
    given: dict[str, object] = {
        "parallelism": Parallelism(n_stages=2, n_chunks=n_chunks),
        "data": Data(batch=BATCH, seq_len=SEQ_LEN),
        "slicing": Plan.gpipe(BATCH, SEQ_LEN),
        "timing": Timing(steps=1, timeout_s=60),
    }
    return RunConfig(model="tiny", schedule_name=schedule, **(given | (fields or {})))  # type: ignore[arg-type]


@pytest.mark.system
@pytest.mark.parametrize(
    ("schedule", "v", "fmt"),
    [
        ("gpipe", 1, "compute_comms"),
        ("1f1b", 1, "compute_only"),
        ("interleaved-1f1b", 2, "compute_comms"),
        ("zbv", 2, "compute_only"),
    ],
)
def test_torch_runs_a_tplib_schedule_as_tplib_does(
    pools: Callable[[int], LocalPool], schedule: str, v: int, fmt: str
) -> None:
    run = _run(schedule, v)
    ours = pools(2).run(run, Hooks(collect_grads=True))
    theirs = run_torch(run, fmt=fmt)  # type: ignore[arg-type]
    assert len(theirs.microbatch_losses) == BATCH
    assert abs(theirs.loss - ours.losses[0]) <= 1e-5 * abs(ours.losses[0])
    grads = ours.grads()
    assert set(theirs.grads) == set(grads)
    for key, g in grads.items():
        assert_scaled_close(theirs.grads[key], g, what=f"grad {key}")


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"parallelism": Parallelism(n_stages=2, n_data=2), "slicing": Plan.gpipe(2, SEQ_LEN)},
            "n_data=2",
        ),
        ({"parallelism": Parallelism(n_stages=2, n_cp=2)}, "n_cp=2"),
        ({"recompute": "full"}, "recompute='full'"),
        ({"recompute": "selective"}, "recompute='selective'"),
        ({"model_overrides": (("dropout", 0.1),)}, "dropout=0.1"),
    ],
)
def test_what_torchs_runtime_would_compute_otherwise_is_refused(
    fields: dict[str, object], says: str
) -> None:
    run = _run("1f1b", fields=fields)
    with pytest.raises(ValueError, match=says):
        run_torch(run)


def test_a_schedule_of_another_batch_or_of_token_slices_is_refused() -> None:
    run = _run("1f1b")
    with pytest.raises(ValueError, match="covers batch=2, seq_len=16 but the run trains batch=4"):
        run_torch(run, make_schedule("1f1b", 2, Plan.gpipe(2, SEQ_LEN)))
    sliced = make_schedule("terapipe", 2, Plan.uniform(BATCH, SEQ_LEN, n_token_slices=2))
    with pytest.raises(ValueError, match="carry no key/value context"):
        run_torch(run, sliced)
    uneven = make_schedule("1f1b", 2, Plan((1, 3), ((SEQ_LEN,), (SEQ_LEN,))))
    with pytest.raises(ValueError, match="torch splits the batch into equal microbatches"):
        run_torch(run, uneven)
