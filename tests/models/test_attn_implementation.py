"""``model.attn_implementation``: the kernel asked for is the one the model runs, and the
errors for one that cannot run are clear.

Tolerance of eager vs sdpa (FP32, CPU, right-padded batch as SFT collates it): loss
within 1e-5 absolute (measured 0.0), gradients within 1e-5 of the largest gradient
(measured ~5e-7); the two compute the same softmax in a different order.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import compose_sft
from veoptim.config import to_config
from veoptim.config.schema import ModelConfig, ParallelConfig
from veoptim.distributed import build_parallel_plan, init_distributed
from veoptim.errors import ConfigError
from veoptim.models.attention import check_attn_implementation
from veoptim.models.build import build_model

VOCAB = 128
LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-5


def loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding, as SFT batches are collated
    mask[3, 8:] = 0
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    token_loss = F.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(mask[:, 1:])
    loss = (token_loss * mask[:, 1:]).sum() / mask[:, 1:].sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_eager_and_sdpa_agree(arch: str) -> None:
    cfg = ModelConfig(arch=arch, num_experts=4 if arch != "qwen2" else 0)
    runs = {}
    for attn in ("sdpa", "eager"):
        model = build_model(replace(cfg, attn_implementation=attn), VOCAB)
        assert model.config._attn_implementation == attn
        runs[attn] = loss_and_grads(model)
    (sdpa_loss, sdpa_grads), (eager_loss, eager_grads) = runs["sdpa"], runs["eager"]
    assert abs(sdpa_loss - eager_loss) <= LOSS_TOL
    scale = max(g.abs().max().item() for g in eager_grads.values())
    worst = max((sdpa_grads[n] - g).abs().max().item() for n, g in eager_grads.items())
    assert worst <= GRAD_REL_TOL * scale


def test_model_path_gets_the_kernel_asked_for(tmp_path: Path) -> None:
    """A loaded model (rank 0) and its meta twin (other ranks) both run the asked kernel."""
    build_model(ModelConfig(), VOCAB).save_pretrained(tmp_path)
    for attn in ("eager", "sdpa"):
        cfg = ModelConfig(path=str(tmp_path), attn_implementation=attn)
        assert build_model(cfg, VOCAB).config._attn_implementation == attn
        assert build_model(cfg, VOCAB, on_meta=True).config._attn_implementation == attn
    # The export's config.json stays kernel-free: whoever loads it chooses.
    assert "attn_implementation" not in (tmp_path / "config.json").read_text()


def test_unknown_kernel_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model.attn_implementation must be one of"):
        to_config(compose_sft(["model.attn_implementation=flash"]))
    with pytest.raises(ConfigError, match=r"model.attn_implementation must be one of"):
        build_model(ModelConfig(attn_implementation="flex"), VOCAB)


def test_flash_attention_needs_its_package() -> None:
    if check_flash_installed():
        pytest.skip("flash_attn is installed")
    with pytest.raises(ConfigError, match="needs the flash_attn package, which is not installed"):
        to_config(compose_sft(["model.attn_implementation=flash_attention_2"]))
    with pytest.raises(ConfigError, match="needs the flash_attn package"):
        build_model(ModelConfig(attn_implementation="flash_attention_2"), VOCAB)


def test_flash_attention_is_refused_off_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the package importable (a stand-in package here), the device decides."""
    model = build_model(ModelConfig(), VOCAB)  # before the stand-in exists
    model.config._attn_implementation = "flash_attention_2"
    plan = build_parallel_plan(ParallelConfig(), init_distributed("cpu", "auto", {}), 0)
    if not check_flash_installed():
        (tmp_path / "flash_attn").mkdir()
        (tmp_path / "flash_attn" / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="runs only on CUDA, but run.device=cpu"):
        to_config(compose_sft(["model.attn_implementation=flash_attention_2", "run.device=cpu"]))
    # run.device=auto resolved to cpu: the parallel plan refuses the model.
    with pytest.raises(ConfigError, match="runs only on CUDA, but the device is cpu"):
        plan.apply(model)
    check_attn_implementation("flash_attention_2", "cuda")


def check_flash_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None
