import pytest
import torch

from tplib.config import MODELS, GPTConfig, get_config, n_params, stage_params
from tplib.model import build_model


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
