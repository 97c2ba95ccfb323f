"""The backend rule on fake GPUs: gloo on CPU; on CUDA, NCCL when no two ranks share a
physical GPU (compared by UUID under torchrun, by device index on one machine), gloo
otherwise; an asked-for backend that cannot work is refused naming the values and the
rule. And which GPU a rank makes current, and when it makes one current at all."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tplib.runtime.backend import (
    RULE,
    BackendChoice,
    BackendError,
    choose_backend,
    gpu_index,
    local_gpus,
    needs_gpu,
)


def _uuids(n: int) -> list[str]:
    return [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(n)]


def test_cpu_runs_use_gloo_and_refuse_nccl() -> None:
    assert choose_backend("cpu", 4) == BackendChoice(
        "gloo", "4 ranks on CPU; NCCL moves GPU tensors only"
    )
    assert choose_backend("cpu", 4, asked="gloo").backend == "gloo"
    with pytest.raises(BackendError) as err:
        choose_backend("cpu", 4, asked="nccl")
    assert "backend 'nccl' for a run on device 'cpu': NCCL moves GPU tensors only" in str(err.value)
    assert RULE in str(err.value)


def test_a_gpu_each_is_nccl_printed_in_one_line() -> None:
    choice = choose_backend("cuda", 16, _uuids(16))
    assert str(choice) == "backend nccl: 16 ranks, each with a GPU of its own"
    asked = choose_backend("cuda", 16, _uuids(16), "nccl")
    assert str(asked) == "backend nccl: 16 ranks, each with a GPU of its own, as asked"


def test_one_visible_gpu_per_process_is_still_nccl() -> None:
    """SLURM's --gpus-per-task=1: every process sees one device, its index 0, so every
    local rank takes "GPU 0" (gpu_index), yet each is another physical GPU. The old rule
    (device_count() >= LOCAL_WORLD_SIZE: 1 >= 8) chose gloo here."""
    assert [gpu_index(local_rank, 1) for local_rank in range(8)] == [0] * 8
    assert choose_backend("cuda", 16, _uuids(16)).backend == "nccl"


def test_ranks_sharing_a_gpu_use_gloo_and_refuse_nccl() -> None:
    uuids = _uuids(8)
    uuids[5] = uuids[1]  # ranks 1 and 5 on one GPU
    choice = choose_backend("cuda", 8, uuids)
    assert choice.backend == "gloo"
    assert f"ranks 1, 5 share GPU {uuids[1]}" in choice.reason
    assert "tensors staged through host memory" in choice.reason
    with pytest.raises(BackendError) as err:
        choose_backend("cuda", 8, uuids, "nccl")
    message = str(err.value)
    assert message.startswith(f"backend 'nccl' with ranks 1, 5 share GPU {uuids[1]}: NCCL refuses")
    assert RULE in message and "or use gloo" in message


def test_many_shared_gpus_are_counted_not_listed() -> None:
    gpus = [f"node0-gpu{r % 2}" for r in range(12)]  # 12 ranks on 2 GPUs
    reason = choose_backend("cuda", 12, gpus).reason
    assert reason.startswith("ranks 0, 2, 4, 6 and 2 more share GPU node0-gpu0 (12 ranks on 2")


def test_gloo_can_be_asked_for_on_gpus_of_their_own() -> None:
    choice = choose_backend("cuda", 4, _uuids(4), "gloo")
    assert choice.backend == "gloo" and "as asked" in choice.reason


@pytest.mark.parametrize("asked", ["NCCL", "mpi", ""])
def test_an_unknown_backend_is_named(asked: str) -> None:
    with pytest.raises(BackendError, match=rf"backend={asked!r}: choose 'nccl' or 'gloo'"):
        choose_backend("cuda", 2, _uuids(2), asked)


def test_a_gpu_list_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="3 GPUs given for 4 ranks"):
        choose_backend("cuda", 4, _uuids(3))


def test_local_ranks_take_gpus_in_turn() -> None:
    assert local_gpus("cuda", 4, 2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert local_gpus("cpu", 4, 2) == []
    # The local rule: NCCL when device_count() >= world size.
    assert choose_backend("cuda", 2, local_gpus("cuda", 2, 8)).backend == "nccl"
    assert choose_backend("cuda", 4, local_gpus("cuda", 4, 4)).backend == "nccl"
    assert choose_backend("cuda", 4, local_gpus("cuda", 4, 3)).backend == "gloo"


def test_gpu_index() -> None:
    assert [gpu_index(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(BackendError, match=r"device 'cuda', but this process sees 0 GPUs"):
        gpu_index(0, 0)


def test_only_ranks_that_use_cuda_make_a_gpu_current() -> None:
    assert needs_gpu("nccl", None) and needs_gpu("nccl", "cuda")
    assert needs_gpu("gloo", "cuda")  # staged, but the run computes on the GPU
    assert not needs_gpu("gloo", None)  # a pool that has only started
    assert not needs_gpu("gloo", "cpu")  # a CPU run on a GPU node: no CUDA context


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12), st.sampled_from([None, "nccl", "gloo"])
)
def test_nccl_exactly_when_every_gpu_is_distinct(gpus: list[int], asked: str | None) -> None:
    labels = [f"GPU-{g}" for g in gpus]
    distinct = len(set(labels)) == len(labels)
    if asked == "nccl" and not distinct:
        with pytest.raises(BackendError, match="NCCL refuses two ranks of a communicator"):
            choose_backend("cuda", len(labels), labels, asked)
        return
    choice = choose_backend("cuda", len(labels), labels, asked)
    assert choice.backend == (asked or ("nccl" if distinct else "gloo"))
