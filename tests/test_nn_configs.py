import pytest
import torch

from tplib.nn.configs import MODELS, GPTConfig, get_config, n_params, stage_params
from tplib.nn.model import GPTStage, build_model
from tplib.nn.oppart import OpGroup


@pytest.mark.parametrize(
    ("name", "expected"),
    [("GPT3-1B", 1.3e9), ("GPT3-13B", 13e9), ("GPT3-44B", 44e9), ("GPT3-175B", 175e9)],
)
def test_paper_models_match_their_names(name: str, expected: float) -> None:
    assert abs(n_params(get_config(name)) / expected - 1) < 0.03


@pytest.mark.parametrize(
    ("name", "layers", "hidden"),
    [
        ("GPT3-1B", 24, 2048),
        ("GPT3-13B", 40, 5120),
        ("GPT3-44B", 96, 6144),
        ("GPT3-175B", 96, 12288),
    ],
)
def test_paper_models_follow_table_1(name: str, layers: int, hidden: int) -> None:
    cfg = get_config(name)
    assert (cfg.n_layer, cfg.hidden, cfg.head_dim, cfg.seq_len, cfg.vocab_size) == (
        layers,
        hidden,
        128,
        2048,
        50257,
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_count_equals_built_model_on_meta(name: str) -> None:
    model = build_model(get_config(name), device="meta")
    assert sum(p.numel() for p in model.parameters()) == n_params(get_config(name))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("lo", "hi"), [(0, 4), (0, 1), (1, 3), (3, 4)])
def test_stage_count_equals_built_stage_on_meta(lo: int, hi: int, tied: bool) -> None:
    cfg = get_config("tiny").with_(tie_embeddings=tied)
    stage = build_model(cfg, lo, hi, device="meta")
    assert sum(p.numel() for p in stage.parameters()) == stage_params(cfg, lo, hi)


def test_175b_builds_on_meta_without_memory() -> None:
    model = build_model(get_config("gpt3-175b"), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_untied_head_adds_its_matrix() -> None:
    cfg = get_config("tiny")
    untied = cfg.with_(tie_embeddings=False)
    assert n_params(untied) - n_params(cfg) == cfg.vocab_size * cfg.hidden
    model = build_model(untied)
    assert sum(p.numel() for p in model.parameters()) == n_params(untied)
    assert model.head.weight is not model.wte.weight
    assert not torch.equal(model.head.weight, model.wte.weight)


def test_unknown_model_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'gpt-5'.*GPT3-175B"):
        get_config("gpt-5")


def test_bad_config_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"hidden=30 is not divisible by n_head=4"):
        GPTConfig("x", n_layer=1, hidden=30, n_head=4)
    with pytest.raises(ValueError, match=r"n_layer=0"):
        GPTConfig("x", n_layer=0, hidden=32, n_head=4)


def test_a_named_config_with_overrides() -> None:
    cfg = get_config("small", (("hidden", 128), ("n_head", 2)))
    assert (cfg.name, cfg.hidden, cfg.n_head, cfg.n_layer) == ("small", 128, 2, 8)
    assert get_config("small", ()) is get_config("small")
    with pytest.raises(ValueError, match="not divisible by n_head=3"):
        get_config("small", (("n_head", 3),))


# ---- one op rank's parameters -------------------------------------------------------------


def _unique_numel(stage: torch.nn.Module) -> int:
    # parameters() yields a tied (shared) tensor once; count by identity to be sure.
    unique = {id(p): p for _, p in stage.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values())


@pytest.mark.parametrize("n_op", [1, 2, 4])
@pytest.mark.parametrize(("lo", "hi"), [(0, 4), (0, 1), (0, 2), (1, 3), (2, 4), (3, 4)])
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"vocab_size": 95},  # padded: 96 rows over 2 or 4 ranks
        {"vocab_size": 93, "tie_embeddings": False},  # padded to 94 (#Op 2) or 96 (#Op 4)
    ],
    ids=["tiny", "vocab95", "vocab93-untied"],
)
def test_op_rank_count_equals_built_shard_on_meta(
    lo: int, hi: int, n_op: int, changes: dict[str, object]
) -> None:
    cfg = get_config("tiny").with_(**changes)
    for rank in range(n_op):
        with torch.device("meta"):
            stage = GPTStage(cfg, lo, hi, OpGroup(rank, n_op))
        assert _unique_numel(stage) == stage_params(cfg, lo, hi, n_op), (rank, n_op)


@pytest.mark.parametrize(("name", "n_op"), [("GPT3-1B", 8), ("GPT3-13B", 8), ("small", 4)])
def test_op_rank_count_of_larger_models(name: str, n_op: int) -> None:
    cfg = get_config(name)
    n = cfg.n_layer
    for lo, hi in [(0, n), (0, 1), (1, n - 1), (n - 1, n)]:
        with torch.device("meta"):
            stage = GPTStage(cfg, lo, hi, OpGroup(n_op - 1, n_op))
        assert _unique_numel(stage) == stage_params(cfg, lo, hi, n_op), (lo, hi)


def test_op_rank_count_by_hand() -> None:
    """tiny (hidden 32, 4 layers, vocabulary 95, context 64), one middle layer over 2 ranks:
    QKV 32 x 48 + 48, projection 16 x 32 + 32, FC1 32 x 64 + 64, FC2 64 x 32 + 32, two
    LayerNorms 4 x 32; the first stage adds 48 vocabulary rows and 64 positions of 32."""
    cfg = get_config("tiny").with_(vocab_size=95)
    layer = (32 * 48 + 48) + (16 * 32 + 32) + (32 * 64 + 64) + (64 * 32 + 32) + 4 * 32
    assert stage_params(cfg, 1, 2, 2) == layer
    assert stage_params(cfg, 0, 1, 2) == layer + 48 * 32 + 64 * 32
    # The last stage: the final LayerNorm and its own copy of the tied head's 48 rows.
    assert stage_params(cfg, 3, 4, 2) == layer + 2 * 32 + 48 * 32
