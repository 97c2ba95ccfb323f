"""Tests for tplib.cluster.memory: peak memory per GPU of a plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from tplib.cluster import CALIBRATIONS, DGX_A100, ClusterCostModel, Implementation, memory_per_gpu
from tplib.cluster.memory import (
    activation_rates,
    peak_in_flight,
    schedule_memory_per_gpu,
    stage_memory_on_cluster,
    state_bytes,
)
from tplib.cluster.runtime_memory import stage_memory
from tplib.nn.bytecount import gradient_bytes, parameter_bytes
from tplib.nn.configs import GPTConfig, get_config, n_params_per_layer
from tplib.nn.model import build_model
from tplib.nn.optimizer import make_optimizer
from tplib.paper import SETTINGS, TERAPIPE, main_row
from tplib.plan import Plan, Unit
from tplib.runtime import Data, LocalPool, Parallelism, RunConfig, RunResult, Timing
from tplib.runtime.benchmark import modelled_memory
from tplib.schedule import Action, Kind, make_schedule, registered


def test_paper_plans_fit_and_slicing_saves_scores() -> None:
    for s in SETTINGS.values():
        m = ClusterCostModel.for_setting(s)
        gpipe, tera = m.memory(s.gpipe_plan()), m.memory(main_row(s.index, TERAPIPE).plan)
        assert gpipe.fits, (s.index, str(gpipe))
        assert tera.total <= gpipe.total + 1  # token slicing stores fewer attention scores


def test_states_and_what_does_not_fit() -> None:
    # GPT3-175B on 24 stages x 8 GPUs: 4 layers of weights and Adam states per GPU.
    too_big = memory_per_gpu("GPT3-175B", n_stages=24, n_op=8, plan=Plan.gpipe(1, 2048))
    assert not too_big.fits and "does NOT fit" in str(too_big)
    # Mixed precision: 20 bytes per parameter (fp16 weights and grads, fp32 master weights,
    # grads, Adam m and v).
    one = memory_per_gpu("GPT3-1B", n_stages=24, n_op=1, plan=Plan.gpipe(1, 2048))
    assert one.states == pytest.approx(20 * n_params_per_layer(get_config("GPT3-1B")))


def test_token_slices_store_fewer_scores() -> None:
    """A slice of s tokens after c keeps s (c + s) scores: halves 1024 + 1024 keep
    1024^2 + 2048 * 1024 = 3/4 of the 2048^2 scores of one slice, per head and layer,
    at 6 bytes each (fp16 scores, fp32 probabilities)."""
    whole = memory_per_gpu("GPT3-1B", n_stages=24, n_op=1, plan=Plan.gpipe(1, 2048))
    halves = memory_per_gpu(
        "GPT3-1B", n_stages=24, n_op=1, plan=Plan.uniform(1, 2048, n_token_slices=2)
    )
    heads = 16
    saved = heads * (2048**2 - (1024**2 + 2048 * 1024)) * 6
    assert whole.activations - halves.activations == pytest.approx(saved)


# ---- peak_in_flight on hand-written action lists -----------------------------------------


def _acts(*items: str) -> list[Action]:
    return [Action.parse(text, stage=0) for text in items]


SIZES = {Unit(0, 0): 1.0, Unit(0, 1): 10.0, Unit(0, 2): 100.0, Unit(1, 0): 1000.0}


def _kept(a: Action) -> float:
    return SIZES[a.unit]


def _by_unit(sizes: dict[Unit, float]) -> Callable[[Action], float]:
    return lambda a: sizes[a.unit]


def test_peak_in_flight_fill_drain_keeps_every_unit() -> None:
    actions = _acts("F b0 t0", "F b0 t1", "F b0 t2", "F b1 t0", "B b1 t0", "B b0 t2", "B b0 t1")
    assert peak_in_flight(actions, _kept) == 1111.0
    assert peak_in_flight([], _kept) == 0.0


def test_peak_in_flight_frees_at_backward() -> None:
    # F0 F1 B1 F2 B2 B0 ... alive: {0}, {0,1}, {0}, {0,2}, {0}: the peak is 1 + 100.
    actions = _acts("F b0 t0", "F b0 t1", "B b0 t1", "F b0 t2", "B b0 t2", "B b0 t0")
    assert peak_in_flight(actions, _kept) == 101.0
    # The same with b1's 1000 after everything else is freed: 1000 alone.
    assert peak_in_flight([*actions, *_acts("F b1 t0", "B b1 t0")], _kept) == 1000.0


def test_peak_in_flight_ignores_communication_and_update() -> None:
    bare = _acts("F b0 t0", "F b0 t1", "B b0 t1", "B b0 t0")
    noisy = [
        *_acts("RA b0 t0", "F b0 t0", "SA b0 t0", "RA b0 t1", "F b0 t1", "SA b0 t1"),
        *_acts("RG b0 t1", "B b0 t1", "SG b0 t1", "RG b0 t0", "B b0 t0", "SG b0 t0"),
        Action(Kind.AR, 0),
        Action(Kind.OPT, 0),
    ]
    assert peak_in_flight(bare, _kept) == peak_in_flight(noisy, _kept) == 11.0


def test_peak_in_flight_adds_the_unit_rebuilt_during_its_backward() -> None:
    """Recomputation: each unit keeps ``kept`` until its backward, during which its
    ``rebuilt`` activations exist too (alive before the unit is released)."""
    actions = _acts("F b0 t0", "F b0 t1", "F b0 t2", "B b0 t2", "B b0 t1", "B b0 t0")
    inputs = {Unit(0, t): 1.0 for t in range(3)}
    rebuilt = {Unit(0, 0): 50.0, Unit(0, 1): 20.0, Unit(0, 2): 5.0}
    # B t2: 3 inputs + 5 = 8; B t1: 2 inputs + 20 = 22; B t0: 1 input + 50 = 51.
    assert peak_in_flight(actions, _by_unit(inputs), _by_unit(rebuilt)) == 51.0
    # Without the rebuilt term only the inputs count.
    assert peak_in_flight(actions, _by_unit(inputs)) == 3.0
    # A large kept set beats the rebuilt one: B t2 with kept 100 each: 300 + 5.
    big = {u: 100.0 for u in inputs}
    assert peak_in_flight(actions, _by_unit(big), _by_unit(rebuilt)) == 305.0


# ---- any schedule on the cluster: weight versions and units in flight ----------------------

# One layer per stage on K = 2, hidden 8, 2 heads, #Op 1. By hand:
# parameters per layer 12 h^2 + 13 h = 768 + 104 = 872; states 20 B each = 17440 B, and an
# extra weight version is an fp16 copy, 2 B each = 1744 B.
# Activations per token 8 hidden x 2 B x (5 + 12) = 272 B, per score 2 heads x 6 B = 12 B.
# A whole 16-token sequence keeps 16 x 272 + 16 x 16 x 12 = 4352 + 3072 = 7424 B; its
# input alone 16 x 8 x 2 = 256 B. Halves of 8 tokens: the first 8 x 272 + 8 x 8 x 12 =
# 2944 B, the second (context 8) 2176 + 8 x 16 x 12 = 3712 B.
TOY = GPTConfig("toy", n_layer=2, hidden=8, n_head=2, seq_len=16)
STATES, VERSION, SEQUENCE, INPUT = 17440.0, 1744.0, 7424.0, 256.0
RESERVE = 2 * 2**30


def _stage(name: str, plan: Plan, stage: int, recompute: str = "none", **kw: int) -> float:
    sched = make_schedule(name, 2, plan, **kw)  # type: ignore[arg-type]
    m = stage_memory_on_cluster(TOY, sched, stage, n_op=1, recompute=recompute)
    return m.total - RESERVE


def test_schedule_memory_by_hand() -> None:
    one, four = Plan.gpipe(1, 16), Plan.gpipe(4, 16)
    # PipeDream: stage 0 holds two weight versions and two minibatches in flight; stage 1
    # one of each.
    assert _stage("pipedream", one, 0, n_iterations=6) == STATES + VERSION + 2 * SEQUENCE
    assert _stage("pipedream", one, 1, n_iterations=6) == STATES + SEQUENCE
    # ... with recomputation: two inputs kept, one sequence rebuilt in its backward.
    got = _stage("pipedream", one, 0, "full", n_iterations=6)
    assert got == STATES + VERSION + 2 * INPUT + SEQUENCE
    # 2BW: two versions on every stage; GPipe keeps all four microbatches, 1F1B two.
    assert _stage("2bw", four, 1, n_iterations=3) == STATES + VERSION + SEQUENCE
    assert _stage("gpipe", four, 0) == STATES + 4 * SEQUENCE
    assert _stage("1f1b", four, 0) == STATES + 2 * SEQUENCE
    # Token slices under 1F1B, stage 0: F00 F01 F10 B01 F11 B00 B11 B10, at most two
    # first halves and one second half alive: 2 x 2944 + 3712. Fill-drain keeps all four.
    halves = Plan.uniform(2, 16, n_token_slices=2)
    assert _stage("1f1b", halves, 0) == STATES + 2 * 2944 + 3712
    assert _stage("terapipe", halves, 0) == STATES + 2 * (2944 + 3712)


def test_schedule_memory_picks_the_worst_stage() -> None:
    sched = make_schedule("pipedream", 2, Plan.gpipe(1, 16), n_iterations=6)
    worst, stage = schedule_memory_per_gpu(TOY, sched, n_op=1)
    assert stage == 0 and worst.total - RESERVE == STATES + VERSION + 2 * SEQUENCE


def test_schedule_memory_of_fill_drain_is_memory_per_gpu() -> None:
    """A fill-drain schedule keeps the whole minibatch: the schedule-aware model gives
    what memory_per_gpu computes from the plan alone."""
    s = SETTINGS[9]
    tera = main_row(9, TERAPIPE).plan
    sched = make_schedule("terapipe", s.n_stages, tera, validate=False)
    got, _ = schedule_memory_per_gpu(s.config, sched, n_op=s.n_op)
    want = memory_per_gpu(s.config, n_stages=s.n_stages, n_op=s.n_op, plan=tera)
    assert got.total == pytest.approx(want.total, rel=1e-12)
    gpipe = make_schedule("gpipe", s.n_stages, s.gpipe_plan(), validate=False)
    got, _ = schedule_memory_per_gpu(s.config, gpipe, n_op=s.n_op, recompute="full")
    want = memory_per_gpu(
        s.config, n_stages=s.n_stages, n_op=s.n_op, plan=s.gpipe_plan(), recompute="full"
    )
    assert got.total == pytest.approx(want.total, rel=1e-12)


# ---- the runtime memory model against measurement (local gloo processes) ----------------


@pytest.mark.parametrize(("lo", "hi"), [(0, 4), (0, 2), (1, 3), (2, 4)])
def test_fp16_states_are_the_optimizers_buffers(lo: int, hi: int) -> None:
    """fp16's 18 bytes per parameter (and Adam's step counters) are what an fp16 stage
    and its optimizer hold after a step, measured on CPU: the fp16 weights, the fp32 main
    grads that are also the master gradients, the masters, Adam's moments; no fp16 .grad
    is left."""
    cfg = get_config("tiny")
    stage = build_model(cfg, lo, hi, dtype=torch.float16)
    opt = make_optimizer(
        stage.parameters(), "fp16", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8
    )
    x = (
        torch.randint(0, cfg.vocab_size, (1, 16))
        if stage.is_first
        else torch.randn(1, 16, cfg.hidden, dtype=torch.float16)
    )
    out = stage(x, targets=torch.randint(0, cfg.vocab_size, (1, 16)) if stage.is_last else None)
    out.float().sum().backward()
    assert opt.step(bool(opt.unscale_grads().item()))
    assert all(p.grad is None for p in stage.parameters())
    measured = parameter_bytes(stage) + gradient_bytes(stage) + opt.state_bytes()
    plan, one = Plan.gpipe(1, 16), (Action(Kind.F, 0, 0, 0),)
    modelled = stage_memory(cfg, lo, hi, plan=plan, actions=one, precision="fp16")
    assert modelled.states == measured


# tiny, 2 stages, 4 sequences of 32 tokens; TeraPipe and 1F1B cut each into 4 token slices,
# GPipe runs unsliced microbatches of one sequence.
MEASURED_SCHEDULES = ("gpipe", "terapipe", "1f1b")
# The virtual stages of an interleaved order and of a V (two chunks per stage), each
# with and without #Op and recomputation, not every pair of them.
CHUNKED = [
    ("terapipe-interleaved", 1, "none"),
    ("terapipe-interleaved", 2, "full"),
    ("terapipe-zbv", 1, "full"),
    ("terapipe-zbv", 2, "none"),
]
RECOMPUTE = ("none", "full")
N_OPS = (1, 2)


def _run_config(
    schedule: str, n_op: int, recompute: str, dropout: float = 0.0, sequence_parallel: bool = False
) -> RunConfig:
    return RunConfig(
        model="tiny",
        schedule_name=schedule,
        parallelism=Parallelism(
            n_stages=2,
            n_op=n_op,
            n_chunks=registered(schedule).default_chunks,
            sequence_parallel=sequence_parallel,
        ),
        data=Data(batch=4, seq_len=32),
        slicing=1 if schedule == "gpipe" else 4,
        timing=Timing(steps=2, timeout_s=60),
        recompute=recompute,
        model_overrides=(("dropout", dropout),) if dropout else (),
    )


Measured = Callable[..., tuple[RunConfig, RunResult]]


@pytest.fixture(scope="module")
def measured(pools: Callable[[int], LocalPool]) -> Measured:
    """Runs on the module's pools, each configuration run once and cached."""
    results: dict[tuple[str, int, str, float, bool], tuple[RunConfig, RunResult]] = {}

    def get(
        schedule: str,
        n_op: int,
        recompute: str,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
    ) -> tuple[RunConfig, RunResult]:
        key = (schedule, n_op, recompute, dropout, sequence_parallel)
        if key not in results:
            run = _run_config(schedule, n_op, recompute, dropout, sequence_parallel)
            results[key] = run, pools(run.parallelism.world_size).run(run)
        return results[key]

    return get


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("schedule", MEASURED_SCHEDULES)
@pytest.mark.parametrize("n_op", N_OPS)
def test_stage_memory_matches_the_measured_runtime(
    measured: Measured, n_op: int, schedule: str, recompute: str
) -> None:
    _check_model_against_measurement(*measured(schedule, n_op, recompute), n_op)


@pytest.mark.parametrize(("schedule", "n_op", "recompute"), CHUNKED)
def test_rank_memory_with_virtual_stages_matches_the_measured_runtime(
    measured: Measured, schedule: str, n_op: int, recompute: str
) -> None:
    _check_model_against_measurement(*measured(schedule, n_op, recompute), n_op)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("n_op", N_OPS)
def test_stage_memory_with_dropout_matches_the_measured_runtime(
    measured: Measured, n_op: int, recompute: str
) -> None:
    # Dropout writes attention out: the scores it keeps grow with each slice's context.
    run, result = measured("terapipe", n_op, recompute, 0.1)
    without = measured("terapipe", n_op, recompute)[1]
    assert max(result.stage_peak_bytes()) > max(without.stage_peak_bytes())
    _check_model_against_measurement(run, result, n_op)


@pytest.mark.parametrize("n_op", N_OPS)
def test_stage_memory_with_selective_recomputation_matches_the_measured_runtime(
    measured: Measured, n_op: int
) -> None:
    # With dropout each attention core keeps its scores; selective keeps none of them
    # (and rebuilds one layer's inside its backward), measured and modelled alike.
    run, result = measured("terapipe", n_op, "selective", 0.1)
    plain, kept = measured("terapipe", n_op, "none", 0.1)
    assert max(result.stage_peak_bytes()) < max(kept.stage_peak_bytes())
    selective, none = modelled_memory(run), modelled_memory(plain)
    assert all(s.activations < n.activations for s, n in zip(selective, none, strict=True))
    _check_model_against_measurement(run, result, n_op)


def test_stage_memory_with_sequence_parallelism_matches_the_measured_runtime(
    measured: Measured,
) -> None:
    # Each op rank keeps its half of the LayerNorms' inputs and statistics and of the
    # hidden states between stages: less than without sequence parallelism (whose model
    # overestimates this run's activations by 12-13%).
    run, result = measured("terapipe", 2, "none", 0.0, True)
    without = measured("terapipe", 2, "none")[1]
    for stage in range(2):
        sp, tp = (
            max(r.memory.activations_peak for r in x.ranks if r.stage == stage and r.memory)
            for x in (result, without)
        )
        assert sp < tp, (stage, sp, tp)
    _check_model_against_measurement(run, result, 2)


def test_distributed_optimizer_memory_matches_the_measured_runtime(
    pools: Callable[[int], LocalPool],
) -> None:
    """#Data = 2, the optimizer state sharded: each replica keeps its stage's weights and
    gradients, and Adam's m and v of half of them."""
    run = replace(
        _run_config("terapipe", 1, "none"),
        parallelism=Parallelism(n_stages=2, n_data=2, distributed_optimizer=True),
        data=Data(batch=4, seq_len=32),
    )
    result = pools(run.parallelism.world_size).run(run)
    modelled = modelled_memory(run)
    assert len(result.ranks) == 4
    for r in result.ranks:
        assert r.memory is not None and r.memory.source == "counted"
        m, x = modelled[r.stage], r.memory
        where = f"stage {r.stage} replica {r.replica}: modelled {m} vs measured {x}"
        assert abs(m.total / x.total - 1) <= 0.10, where
        states = x.params + x.grads + x.optimizer
        assert abs(m.states / states - 1) <= 0.01, where
        # The unsharded state would be a third too large: the check tells them apart.
        whole = replace(run, parallelism=replace(run.parallelism, distributed_optimizer=False))
        assert modelled_memory(whole)[r.stage].states / states - 1 > 0.3, where


def _check_model_against_measurement(run: RunConfig, result: RunResult, n_op: int) -> None:
    modelled = modelled_memory(run)
    assert len(result.ranks) == 2 * n_op
    for r in result.ranks:
        assert r.memory is not None and r.memory.source == "counted"
        m, x = modelled[r.stage], r.memory
        where = f"stage {r.stage} op rank {r.op_rank}: modelled {m} vs measured {x}"
        assert abs(m.total / x.total - 1) <= 0.10, where
        # Not only the static part, which dominates the total: the activations too.
        assert x.activations_peak > 0, where
        assert abs(m.activations / x.activations_peak - 1) <= 0.10, where
        assert abs(m.contexts / x.contexts - 1) <= 0.10, where
        assert abs(m.states / (x.params + x.grads + x.optimizer) - 1) <= 0.10, where
    # The op ranks of a stage hold equal shares.
    for stage in range(2):
        totals = {r.memory.total for r in result.ranks if r.stage == stage and r.memory}
        assert len(totals) == 1, (stage, totals)


@pytest.mark.parametrize("n_op", N_OPS)
def test_measured_savings_of_1f1b_and_recomputation(
    measured: Callable[[str, int, str], tuple[RunConfig, RunResult]], n_op: int
) -> None:
    def peaks(schedule: str, recompute: str) -> list[int]:
        return measured(schedule, n_op, recompute)[1].stage_peak_bytes()

    # 1F1B bounds the units in flight: the first stage keeps at most 5 of the 16 units
    # (one sequence's 4 token slices and the next one's first), GPipe the whole batch.
    assert peaks("1f1b", "none")[0] < 0.8 * peaks("gpipe", "none")[0]
    for schedule in MEASURED_SCHEDULES:
        none, full = peaks(schedule, "none"), peaks(schedule, "full")
        for stage in range(2):
            assert full[stage] < none[stage], (schedule, stage, full, none)


def test_peak_in_flight_keeps_deferred_weight_inputs_until_their_w() -> None:
    """Split backwards: from a unit's B to the W that covers it, ``deferred(u)`` stays."""
    deferred = {u: 0.5 * s for u, s in SIZES.items()}
    actions = _acts("F b0 t0", "F b0 t1", "B b0 t1", "B b0 t0", "F b1 t0", "W b0", "B b1 t0")
    # F b1 t0 while b0's two units wait for W b0: 1000 + 0.5 + 5 = 1005.5.
    assert peak_in_flight(actions, _kept, deferred=_by_unit(deferred)) == 1005.5
    # With W b0 before F b1 t0 the peak is b1 alone.
    early = _acts("F b0 t0", "F b0 t1", "B b0 t1", "B b0 t0", "W b0", "F b1 t0", "B b1 t0")
    assert peak_in_flight(early, _kept, deferred=_by_unit(deferred)) == 1000.0
    # A per-unit W releases only its unit: W b0 t1 leaves t0's 0.5.
    per_unit = _acts("F b0 t0", "F b0 t1", "B b0 t1", "B b0 t0", "W b0 t1", "F b1 t0")
    assert peak_in_flight(per_unit, _kept, deferred=_by_unit(deferred)) == 1000.5


# ---- virtual stages: a chunk-unit keeps one chunk's layers ---------------------------------

# TOY4: four layers on K = 2 stages, 2 chunks of one layer each: a chunk keeps a whole
# sequence's activations of ONE layer (SEQUENCE), a stage the states of two.
TOY4 = TOY.with_(n_layer=4)


def _chunked(name: str, stage: int, recompute: str = "none") -> float:
    sched = make_schedule(name, 2, Plan.gpipe(4, 16), n_chunks=2)
    m = stage_memory_on_cluster(TOY4, sched, stage, n_op=1, recompute=recompute)
    return m.total - RESERVE


def test_interleaved_1f1b_holds_more_units_of_fewer_layers() -> None:
    """Interleaved 1F1B, K = 2, v = 2, four microbatches: stage 0 warms up with
    2 (K - 1) + (v - 1) K = 4 forwards and runs a fifth before its first backward, stage 1
    with (v - 1) K = 2 and a third: 5 and 3 chunk-units of one layer. 1F1B keeps 2 and 1
    microbatches of two layers; breadth-first, every microbatch on every chunk."""
    assert _chunked("interleaved-1f1b", 0) == 2 * STATES + 5 * SEQUENCE
    assert _chunked("interleaved-1f1b", 1) == 2 * STATES + 3 * SEQUENCE
    sched = make_schedule("1f1b", 2, Plan.gpipe(4, 16))
    flat = stage_memory_on_cluster(TOY4, sched, 0, n_op=1).total - RESERVE
    assert flat == 2 * STATES + 2 * 2 * SEQUENCE
    assert _chunked("looped-bfs", 0) == _chunked("looped-bfs", 1) == 2 * STATES + 8 * SEQUENCE
    # Recomputation: each chunk-unit keeps its own input; one chunk-unit is rebuilt.
    assert _chunked("interleaved-1f1b", 0, "full") == 2 * STATES + 5 * INPUT + SEQUENCE


@pytest.mark.parametrize(("n_stages", "n_chunks"), [(4, 2), (4, 3), (2, 2), (3, 2)])
def test_interleaving_costs_megatrons_share_more_activations(n_stages: int, n_chunks: int) -> None:
    """Megatron's figure for stage 0: 1 + (K - 1) / (vK) times 1F1B's activations, on full
    groups of K microbatches."""
    plan = Plan.gpipe(2 * n_stages, 2048)
    ratio = [
        stage_memory_on_cluster(
            "GPT3-1B", make_schedule(name, n_stages, plan, n_chunks=v), 0, n_op=1
        ).activations
        for name, v in (("interleaved-1f1b", n_chunks), ("1f1b", 1))
    ]
    assert ratio[0] / ratio[1] == pytest.approx(1 + (n_stages - 1) / (n_chunks * n_stages))


def test_peak_in_flight_keeps_a_unit_on_each_chunk_apart() -> None:
    actions = [Action(Kind.F, 0, 0, 0), Action(Kind.F, 0, 0, 0, chunk=1)]
    assert peak_in_flight(actions, _kept) == 2.0  # unit b0 t0 held twice, once per chunk
    actions += [Action(Kind.B, 0, 0, 0, chunk=1), Action(Kind.F, 0, 1, 0)]
    assert peak_in_flight(actions, _kept) == 1001.0  # chunk 0 still holds b0 t0


# ---- modern implementations: what each keeps --------------------------------------


def _megatron_memory(impl: Implementation, recompute: str = "none", n_data: int = 4) -> float:
    cfg = get_config("GPT3-13B")
    schedule = make_schedule("1f1b", 4, Plan.gpipe(8, 2048))
    estimate, _ = schedule_memory_per_gpu(
        cfg, schedule, n_op=8, recompute=recompute, hardware=DGX_A100,
        calibration=CALIBRATIONS["dgx-a100"], implementation=impl, n_data=n_data,
    )  # fmt: skip
    return estimate.total


def test_the_distributed_optimizer_shards_master_weights_and_moments() -> None:
    params = 1e9
    assert state_bytes(params) == 20 * params
    assert (
        state_bytes(params, Implementation(distributed_optimizer=True), 4) == (8 + 12 / 4) * params
    )
    sharded = Implementation(distributed_optimizer=True)
    plain = _megatron_memory(Implementation())
    stage_params = 40 // 4 * n_params_per_layer(get_config("GPT3-13B")) / 8  # K 4, #Op 8
    assert plain - _megatron_memory(sharded) == pytest.approx((20 - 8 - 12 / 4) * stage_params)


def test_scores_kept_by_each_attention_and_none_under_selective_recomputation() -> None:
    cfg = get_config("GPT3-13B")
    per_score = {
        attention: activation_rates(cfg, 8, Implementation(attention=attention))[1]
        for attention in ("unfused", "fused-softmax", "flash")
    }
    heads = cfg.n_head / 8
    assert per_score == {"unfused": heads * 6, "fused-softmax": heads * 5, "flash": 0.0}
    fused = Implementation(attention="fused-softmax")
    assert activation_rates(cfg, 8, fused, "selective")[1] == 0
    assert _megatron_memory(fused, "selective") < _megatron_memory(fused)


def test_sequence_parallelism_splits_the_replicated_activations() -> None:
    cfg = get_config("GPT3-13B")
    plain = activation_rates(cfg, 8, Implementation(attention="flash"))[0]
    sp = activation_rates(cfg, 8, Implementation(attention="flash", sequence_parallel=True))[0]
    assert plain - sp == pytest.approx(cfg.hidden * 2 * 5 * (1 - 1 / 8))
