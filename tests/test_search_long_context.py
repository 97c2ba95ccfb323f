"""The long-context study's question: a method's best layout at length L, its throughput
and MFU by Narayanan et al.'s count, nothing fitting named, and the Seq1F1B seam."""

from __future__ import annotations

import pytest

from tplib.nn.configs import GPTConfig
from tplib.plan import Plan
from tplib.search.long_context import best_layout
from tplib.search.megatron import MegatronRun, predict

L = 131072
SMALL = GPTConfig("small-long", n_layer=4, hidden=1024, n_head=8, seq_len=L, vocab_size=32000)


def test_the_best_layout_of_a_method_with_its_throughput_and_mfu() -> None:
    cp = best_layout(SMALL, 8, L, "cp", batch_tokens=4 * L, memory_gib=16)
    plain = best_layout(SMALL, 8, L, "1f1b", batch=4, memory_gib=16)
    assert cp.fits and plain.fits and cp.cp is not None and cp.cp > 1 and plain.cp == 1
    assert cp.iteration_s < plain.iteration_s and cp.memory_gib <= cp.budget_gib == 16
    # Narayanan et al.: 72 B s l h^2 (1 + s / 6h + V / 12lh), over 8 GPUs' 989 TFLOPS.
    h = 1024
    flops = 72 * 4 * L * 4 * h * h * (1 + L / (6 * h) + 32000 / (12 * 4 * h))
    assert cp.mfu == pytest.approx(flops / (cp.iteration_s * 8 * 989e12))
    assert cp.tokens_per_s_per_gpu == pytest.approx(4 * L / cp.iteration_s / 8)
    run = MegatronRun(
        "dgx-h100", 8, layers=4, hidden=h, heads=8, batch=4, vocab=32000, seq_len=L,
        tp=cp.tp or 0, pp=cp.pp or 0, cp=cp.cp, microbatch=cp.microbatch or 0,
        interleave=cp.v or 0, schedule=cp.schedule, recompute=cp.recompute,
        sequence_parallel=(cp.tp or 0) > 1, distributed_optimizer=True, dropout=0.0,
    )  # fmt: skip
    assert predict(run).iteration_s == pytest.approx(cp.iteration_s)


def test_nothing_fitting_is_named_and_seq1f1b_takes_its_slicing() -> None:
    tight = best_layout(SMALL, 8, L, "1f1b", batch=4, memory_gib=2)
    assert not tight.fits and tight.tp is None and tight.memory_gib > 2
    assert "nothing fits in 2.0 GiB per GPU" in tight.reason
    # By default seq1f1b cuts each sequence into slices of equal FLOPs: longer first.
    default = best_layout(SMALL, 8, L, "seq1f1b", batch=4, memory_gib=16)
    assert default.fits and default.schedule == "seq1f1b"
    first = Plan.from_paper(default.slicing).token_slices[0]
    assert len(first) > 1 and list(first) == sorted(first, reverse=True) and first[0] > first[-1]

    def equal(cfg: GPTConfig, seq_len: int, n: int, grid: int) -> list[int]:
        return [seq_len // n] * n

    sliced = best_layout(SMALL, 8, L, "seq1f1b", batch=4, memory_gib=16, slicing=equal)
    assert sliced.fits and sliced.schedule == "seq1f1b"
    cuts = Plan.from_paper(sliced.slicing).token_slices[0]
    assert len(cuts) in (2, 4, 8) and set(cuts) == {L // len(cuts)}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"method": "ring"}, "method='ring': choose one of"),
        ({"batch": 4, "batch_tokens": 4 * L}, "give the global batch one way"),
        ({"batch_tokens": 3 * L + 1}, "is not a whole number of sequences"),
    ],
)
def test_bad_requests_are_refused(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"method": "cp"} | kw
    with pytest.raises(ValueError, match=match):
        best_layout(SMALL, 8, L, **args)  # type: ignore[arg-type]
