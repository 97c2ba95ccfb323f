"""tplib.nn.hf against Hugging Face's own GPT-2 (transformers' GPT2LMHeadModel).

The reference is a randomly initialised small GPT2LMHeadModel computing with eager
attention in float32. Every parameter is drawn at a scale where each mapping error shows:
biases and LayerNorm parameters are non-zero (Hugging Face initialises them to 0 and 1),
and the MLP's inputs are large enough that GELU's tanh approximation and the exact GELU
differ far beyond the tolerance (checked). The HF -> tplib names below are written out
here, not taken from tplib.nn.hf.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tplib.nn.dropout import DropoutKey
from tplib.nn.model import GPTStage
from tplib.nn.oppart import OpGroup, merge_shards, shard_spec
from tplib.nn.slicing import full_batch_loss, run_pipeline_local
from tplib.plan import Plan

from .conftest import assert_scaled_close

transformers: Any = pytest.importorskip(
    "transformers", reason="tplib.nn.hf is compared with transformers: pip install -e '.[hf]'"
)
safetensors_torch: Any = pytest.importorskip("safetensors.torch", reason="comes with transformers")

from tplib.nn.hf import config_from_hf, load_gpt2  # noqa: E402  (after the skip)

N_LAYER, HIDDEN, N_HEAD, CONTEXT = 4, 64, 4, 64
VOCAB = 97  # odd: #Op = 2 pads it to 98
B, L = 4, 48  # L + 1 <= CONTEXT, so HF can read the L + 1 tokens tplib draws


def _hf_config(**changes: Any) -> Any:
    fields: dict[str, Any] = {
        "n_layer": N_LAYER,
        "n_embd": HIDDEN,
        "n_head": N_HEAD,
        "n_positions": CONTEXT,
        "vocab_size": VOCAB,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,  # GPT-2's 50256 is outside this vocabulary
        "eos_token_id": 0,
        "attn_implementation": "eager",
    }
    return transformers.GPT2Config(**(fields | changes))


@torch.no_grad()
def _hf_model(seed: int = 0, **changes: Any) -> Any:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_hf_config(**changes)).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if re.search(r"ln_\w+\.weight$", name):
            p.copy_(1.0 + 0.2 * noise)
        elif p.ndim == 1:
            p.copy_(0.2 * noise)
        elif name.endswith(("wte.weight", "wpe.weight")):
            p.copy_(0.5 * noise)
        else:  # Conv1D is in x out, lm_head (nn.Linear) out x in: unit-variance outputs
            fan_in = p.shape[1] if name == "lm_head.weight" else p.shape[0]
            p.copy_(noise / fan_in**0.5)
    return model


def _save(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The reference GPT-2 (tanh GELU, tied head) and the directory it is saved in."""
    model = _hf_model()
    return model, _save(model, tmp_path_factory.mktemp("gpt2"))


def _tokens(seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, L + 1), generator=g)


_BLOCK = {
    "ln_1": "ln_1",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "ln_2": "ln_2",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}


def _tplib_name(hf: str) -> tuple[str, bool]:
    """tplib's name of Hugging Face parameter ``hf`` and whether HF stores it transposed."""
    if hf == "lm_head.weight":
        return "head.weight", False
    hf = hf.removeprefix("transformer.")
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", hf)
    if m is None:
        return hf, False  # wte, wpe, ln_f
    layer, module, leaf = m.groups()
    conv1d = module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    return f"blocks.{layer}.{_BLOCK[module]}.{leaf}", conv1d and leaf == "weight"


def _params(stages: list[GPTStage]) -> dict[str, list[torch.nn.Parameter]]:
    """Every copy of each parameter over ``stages`` (the tied head is a second copy of wte)."""
    out: dict[str, list[torch.nn.Parameter]] = {}
    for stage in stages:
        for name, p in stage.named_parameters(remove_duplicate=False):
            out.setdefault(name, []).append(p)
    return out


def _check_against_hf(
    hf: Any, stages: list[GPTStage], use: Callable[[Tensor], Tensor], what: str
) -> None:
    """Every HF parameter's value and gradient (``use`` maps HF's gradient to tplib's
    scale) against every tplib copy of it; every tplib parameter is compared."""
    params = _params(stages)
    tied = hf.config.tie_word_embeddings
    seen: set[str] = set()
    for hf_name, p in hf.named_parameters():
        name, transposed = _tplib_name(hf_name)
        names = [name, "head.weight"] if tied and name == "wte.weight" else [name]
        for n in names:
            for copy in params.get(n, []):
                value, grad = (p.t(), p.grad.t()) if transposed else (p, p.grad)
                assert torch.equal(copy.detach(), value.detach()), f"{what}: {n} value"
                assert_scaled_close(copy.grad, use(grad), what=f"{what}: {n} grad")
                seen.add(n)
    assert seen == set(params), f"{what}: not compared: {set(params) - seen}"


# ---- configuration ------------------------------------------------------------------------


def test_config_from_hf_reads_every_field() -> None:
    hf = _hf_config(
        n_layer=3,
        n_embd=48,
        n_head=6,
        n_positions=40,
        vocab_size=101,
        layer_norm_epsilon=1e-6,
        initializer_range=0.01,
        activation_function="gelu",
        tie_word_embeddings=False,
        n_inner=192,  # 4 x 48, spelled out
        reorder_and_upcast_attn=True,  # same attention, another order under mixed precision
    )
    cfg = config_from_hf(hf, name="mine")
    assert (cfg.name, cfg.n_layer, cfg.hidden, cfg.n_head, cfg.seq_len) == ("mine", 3, 48, 6, 40)
    assert (cfg.vocab_size, cfg.layer_norm_eps, cfg.init_std) == (101, 1e-6, 0.01)
    assert (cfg.gelu, cfg.tie_embeddings) == ("erf", False)
    for act, gelu in [
        ("gelu_new", "tanh"),
        ("gelu_pytorch_tanh", "tanh"),
        ("gelu_fast", "tanh"),
        ("gelu", "erf"),
    ]:
        assert config_from_hf(_hf_config(activation_function=act)).gelu == gelu


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"activation_function": "silu"}, "activation_function='silu'"),
        ({"n_inner": 128}, "n_inner=128"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_config_from_hf_rejects_what_tplib_cannot_compute(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        config_from_hf(_hf_config(**changes))


def test_config_from_hf_rejects_other_models() -> None:
    with pytest.raises(ValueError, match="model_type='gptj'"):
        config_from_hf(transformers.GPTJConfig())


def test_importing_tplib_hf_needs_no_transformers(fresh_python: Callable[..., str]) -> None:
    """``import tplib.nn.hf`` works where transformers is missing (None in sys.modules makes
    its import fail), and loading then says how to install it."""
    out = fresh_python("""
        import tplib.nn.hf
        light("transformers")
        sys.modules["transformers"] = None
        try:
            tplib.nn.hf.load_gpt2(".")
        except ImportError as e:
            print(e)
    """)
    assert "pip install 'tplib[hf]'" in out, out


# ---- equivalence ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("activation", "tied"),
    [
        ("gelu_new", True),
        ("gelu_pytorch_tanh", True),
        ("gelu_fast", True),
        ("gelu", True),
        ("gelu_new", False),
    ],
)
def test_logits_match_hf(tmp_path: Path, activation: str, tied: bool) -> None:
    hf = _hf_model(activation_function=activation, tie_word_embeddings=tied)
    stage = load_gpt2(_save(hf, tmp_path))
    assert stage.cfg.gelu == ("erf" if activation == "gelu" else "tanh")
    assert (stage.head.weight is stage.wte.weight) == tied
    x = _tokens()[:, :-1]
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        assert_scaled_close(stage(x), expected, what=f"{activation} logits")
        # The check can fail: the other GELU's logits are over 10x the tolerance off.
        other = GPTStage(stage.cfg.with_(gelu="erf" if stage.cfg.gelu == "tanh" else "tanh"))
        other.load_state_dict(stage.state_dict())
        err = (other(x) - expected).abs().max() / expected.abs().max()
        assert err > 1e-4, f"the other GELU is within {err:.1e}: the test could not fail"


@pytest.mark.parametrize("tied", [True, False])
def test_loss_and_gradients_match_hf(tmp_path: Path, tied: bool) -> None:
    hf = _hf_model(tie_word_embeddings=tied)
    stage = load_gpt2(_save(hf, tmp_path))
    tokens = _tokens()
    # The same B·L positions: HF reads all L + 1 tokens and shifts its labels by one.
    expected = hf(input_ids=tokens, labels=tokens).loss
    expected.backward()
    loss = full_batch_loss(stage, tokens[:, :-1], tokens[:, 1:])  # sum / (B·L)
    loss.backward()
    assert_scaled_close(loss.detach(), expected.detach(), what="loss")
    _check_against_hf(hf, [stage], lambda g: g, what="whole model")
    # The same L input tokens: HF scores B·(L - 1) positions.
    x = tokens[:, :-1]
    with torch.no_grad():
        short = hf(input_ids=x, labels=x).loss
        ours = stage(x[:, :-1], targets=x[:, 1:]) / (B * (L - 1))
    assert_scaled_close(ours, short, what="loss over L - 1 positions")


def test_sliced_pipeline_matches_hf(gpt2: tuple[Any, Path]) -> None:
    hf, path = gpt2
    hf.zero_grad(set_to_none=True)
    stages = [load_gpt2(path, 0, 2), load_gpt2(path, 2, 4)]
    tokens = _tokens(seed=2)
    expected = hf(input_ids=tokens, labels=tokens).loss
    expected.backward()
    # Uneven token slices (one of a single token), two batch slices of 1 and 3 sequences.
    plan = Plan((1, 3), ((5, 17, 26), (30, 1, 17)))
    loss = run_pipeline_local(stages, tokens[:, :-1], plan, targets=tokens[:, 1:])
    assert_scaled_close(loss, expected.detach(), what="sliced loss")
    # wte (stage 0) and head (stage 1) are two copies: each holds the whole gradient.
    _check_against_hf(hf, stages, lambda g: g, what="sliced")


def test_a_checkpoint_s_dropout_drops_only_with_a_key(tmp_path: Path) -> None:
    hf = _hf_model(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # GPT-2's own rates
    stage = load_gpt2(_save(hf, tmp_path))
    assert stage.cfg.dropout == 0.1
    tokens = _tokens()
    x, targets = tokens[:, :-1], tokens[:, 1:]
    plan = Plan((B,), ((L,),))
    with torch.no_grad():
        expected = hf(input_ids=tokens, labels=tokens).loss  # eval(): no dropout
    # Without a key the loaded model is Hugging Face's in eval() mode ...
    assert_scaled_close(
        run_pipeline_local([stage], x, plan, targets=targets).detach(), expected, what="no key"
    )
    # ... with one it drops, the same elements for the same key.
    key = DropoutKey(seed=7)
    dropped = [
        run_pipeline_local([stage], x, plan, targets=targets, dropout=key).detach()
        for _ in range(2)
    ]
    assert not torch.allclose(dropped[0], expected, rtol=1e-3), "the key dropped nothing"
    assert torch.equal(dropped[0], dropped[1])


# ---- what does not load ----------------------------------------------------------------------


def _variant(src: Path, dst: Path, edit: Callable[[dict[str, Tensor]], object]) -> Path:
    """A copy of checkpoint ``src`` with its state dict edited."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    state = safetensors_torch.load_file(src / "model.safetensors")
    edit(state)
    safetensors_torch.save_file(state, dst / "model.safetensors")
    return dst


def test_unsupported_activation_does_not_load(tmp_path: Path) -> None:
    path = _save(_hf_model(activation_function="relu"), tmp_path)
    with pytest.raises(ValueError, match="activation_function='relu'"):
        load_gpt2(path)


def test_missing_key_raises_with_its_name(gpt2: tuple[Any, Path], tmp_path: Path) -> None:
    key = "transformer.h.1.mlp.c_fc.bias"
    path = _variant(gpt2[1], tmp_path / "missing", lambda s: s.pop(key))
    with pytest.raises(ValueError, match=r"missing keys .*h\.1\.mlp\.c_fc\.bias"):
        load_gpt2(path)
    with pytest.raises(ValueError, match=r"missing keys .*h\.1\.mlp\.c_fc\.bias"):
        load_gpt2(path, 0, 2)
    load_gpt2(path, 2, 4)  # a stage that does not need it loads


def test_unexpected_key_raises_with_its_name(gpt2: tuple[Any, Path], tmp_path: Path) -> None:
    def add_layer(state: dict[str, Tensor]) -> None:
        state["transformer.h.4.ln_1.weight"] = torch.ones(HIDDEN)

    path = _variant(gpt2[1], tmp_path / "extra", add_layer)
    for lo, hi in [(0, 4), (2, 4)]:
        with pytest.raises(ValueError, match=r"unexpected keys.*h\.4\.ln_1\.weight"):
            load_gpt2(path, lo, hi)


def test_wrong_shape_raises_with_its_name(gpt2: tuple[Any, Path], tmp_path: Path) -> None:
    def transpose(state: dict[str, Tensor]) -> None:  # as if saved from nn.Linear
        w = "transformer.h.3.mlp.c_fc.weight"
        state[w] = state[w].t().contiguous()

    path = _variant(gpt2[1], tmp_path / "shape", transpose)
    with pytest.raises(ValueError, match=r"h\.3\.mlp\.c_fc\.weight has shape \(256, 64\)"):
        load_gpt2(path, 2, 4)


def test_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_gpt2(tmp_path / "nowhere")
    _hf_config().save_pretrained(tmp_path)  # a config without weights
    with pytest.raises(FileNotFoundError, match="no GPT-2 weights"):
        load_gpt2(tmp_path)


# ---- checkpoint formats, dtype and #Op shards -------------------------------------------------


def test_every_checkpoint_format_loads_the_same(gpt2: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = gpt2
    reference = dict(load_gpt2(path).named_parameters())
    state = safetensors_torch.load_file(path / "model.safetensors")

    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()

    pickled = tmp_path / "bin"
    pickled.mkdir()
    shutil.copy(path / "config.json", pickled)
    torch.save(state, pickled / "pytorch_model.bin")

    # The hub's original layout: GPT2Model's names, with the causal-mask buffers.
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(path / "config.json", base)
    base_state = {k.removeprefix("transformer."): v for k, v in state.items()}
    for i in range(N_LAYER):
        base_state[f"h.{i}.attn.bias"] = torch.ones(1, 1, CONTEXT, CONTEXT).tril()
    base_state["lm_head.weight"] = state["transformer.wte.weight"].clone()  # ignored: tied
    safetensors_torch.save_file(base_state, base / "model.safetensors")

    for directory in (sharded, pickled, base):
        loaded = dict(load_gpt2(directory).named_parameters())
        assert loaded.keys() == reference.keys()
        for name, p in loaded.items():
            assert torch.equal(p, reference[name]), f"{directory.name}: {name}"

    doubled = load_gpt2(path, 2, 4, dtype=torch.float64)
    for name, p in doubled.named_parameters():
        assert p.dtype == torch.float64
        assert torch.equal(p, reference[name if name != "head.weight" else "wte.weight"].double())


@pytest.mark.parametrize(("lo", "hi"), [(0, 4), (0, 2), (2, 4)])
def test_op_shards_merge_to_the_whole_model(gpt2: tuple[Any, Path], lo: int, hi: int) -> None:
    path = gpt2[1]
    whole = dict(load_gpt2(path, lo, hi).named_parameters(remove_duplicate=False))
    shards = [load_gpt2(path, lo, hi, op=OpGroup(r, 2)) for r in range(2)]
    params = [dict(s.named_parameters(remove_duplicate=False)) for s in shards]
    assert all(p.keys() == whole.keys() for p in params)
    for name, full in whole.items():
        spec = shard_spec(name)
        if spec is not None:
            assert params[0][name].shape != full.shape, f"{name} is not split"
        size = full.shape[spec.dim] if spec is not None else 0
        merged = merge_shards([p[name] for p in params], spec, size)
        assert torch.equal(merged, full), name
    vocab_params = [n for n in whole if n in ("wte.weight", "head.weight")]
    for name in vocab_params:  # 97 words over 2 ranks: rank 1's last row is padding
        assert params[1][name].shape[0] == 49
        assert not params[1][name][-1].any(), f"{name}'s padding row is not zero"


def test_config_from_hf_reads_the_dropout_rate() -> None:
    assert config_from_hf(_hf_config()).dropout == 0.0
    rates = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    assert config_from_hf(_hf_config(**rates)).dropout == 0.1
    with pytest.raises(ValueError, match=r"dropout rates .* differ"):
        config_from_hf(_hf_config(**(rates | {"attn_pdrop": 0.0})))
