"""FSDP2 on 2 gloo ranks: every optimizer type saves through DCP and resumes bitwise in a fresh process.

Two spawns: the first trains, saves model + optimizer with DCP and records the
next step's local shards; the second (fresh processes, differently initialised
model) loads through get_state_dict -> dcp.load -> set_state_dict and must
reproduce that step bit for bit: parameters, masters, moments and step counters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tests.distributed.spawn import free_port, own_process_group, start_ranks
from veoptim.config.schema import OptimConfig
from veoptim.optim import MASTER_WEIGHT, STEP, build_optimizer, dcp_state_init

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

WORLD = 2
TRAIN_STEPS = 3
COMBOS = [
    (name, dtype)
    for name in ("adamw", "full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw")
    for dtype in ("fp32", "bf16")
] + [("full_fp32_adamw+sr", "bf16")]  # stochastic rounding on shards: global element offsets
MOMENTS = {"master_fp32_adamw": "bf16"}


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(torch.tanh(self.attn(x))))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(16, 7)  # 7 rows: uneven shards (4 + 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(tag: str, dtype: str, seed: int):
    name, stochastic = tag.removesuffix("+sr"), tag.endswith("+sr")
    torch.manual_seed(seed)
    model = _Net()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    cfg = OptimConfig(
        name=name,
        lr=1e-2,
        weight_decay=0.1,
        moment_dtype=MOMENTS.get(name, "fp32"),
        cpu_offload_param_patterns=["mlp"],
        chunk_size=64,
        stochastic_rounding=stochastic,
    )
    return model, build_optimizer(model, cfg)


def _train_step(model, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 16, generator=g)
    dtype = next(model.parameters()).dtype
    model(x.to(dtype)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local_snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.to_local().detach().clone()
        for k, v in opt.state[p].items():
            out[f"{n}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _check_layout(model, opt, name: str) -> None:
    for n, p in model.named_parameters():
        state = opt.state[p]
        assert float(state[STEP]) == TRAIN_STEPS + 1, (n, state[STEP])
        for k, v in state.items():
            if k == STEP:
                continue
            assert isinstance(v, DTensor) and v.placements == p.placements, (n, k)
            offloaded = name.startswith("cpu_offload_adamw") and "mlp" in n
            assert v.to_local().device.type == "cpu"
            if offloaded:
                assert v.to_local().data_ptr() != p.to_local().data_ptr()
        if name != "adamw":
            assert state[MASTER_WEIGHT].dtype == torch.float32


NEGATIVE_CONTROL = "full_fp32_adamw-bf16"


def _weights_only_differs(name: str, dtype: str, ckpt: str, rank: int, expected: dict) -> bool:
    """Negative control: restoring only the model weights does not reproduce the next step."""
    model, opt = _build(name, dtype, seed=1)
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    _train_step(model, opt, TRAIN_STEPS, rank)
    got = _local_snapshot(model, opt)
    return not all(torch.equal(expected[k], got[k]) for k in expected if not k.endswith(STEP))


def _worker(rank: int, port: int, out: str, phase: str) -> None:
    torch.set_num_threads(1)
    with own_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}"):
        _run_phase(rank, out, phase)


def _run_phase(rank: int, out: str, phase: str) -> None:
    result: dict[str, bool] = {}
    for name, dtype in COMBOS:
        tag = f"{name}-{dtype}"
        ckpt = os.path.join(out, tag)
        if phase == "save":
            model, opt = _build(name, dtype, seed=0)
            for step in range(TRAIN_STEPS):
                _train_step(model, opt, step, rank)
            with dcp_state_init(opt):
                osd = get_optimizer_state_dict(model, opt)
            dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt)
            _train_step(model, opt, TRAIN_STEPS, rank)
            torch.save(_local_snapshot(model, opt), f"{ckpt}.rank{rank}.pt")
            result[tag] = True
        else:
            model, opt = _build(name, dtype, seed=1)  # different init: weights must come from DCP
            with dcp_state_init(opt):
                sd = {
                    "model": get_model_state_dict(model),
                    "optim": get_optimizer_state_dict(model, opt),
                }
            dcp.load(sd, checkpoint_id=ckpt)
            set_model_state_dict(model, sd["model"])
            with dcp_state_init(opt):
                set_optimizer_state_dict(model, opt, sd["optim"])
            _train_step(model, opt, TRAIN_STEPS, rank)
            _check_layout(model, opt, name)
            expected = torch.load(f"{ckpt}.rank{rank}.pt", weights_only=True)
            got = _local_snapshot(model, opt)
            assert expected.keys() == got.keys(), tag
            result[tag] = all(torch.equal(expected[k], got[k]) for k in expected)
            if tag == NEGATIVE_CONTROL:
                result["weights_only_differs"] = _weights_only_differs(
                    name, dtype, ckpt, rank, expected
                )
    Path(out, f"{phase}.rank{rank}.json").write_text(json.dumps(result))


def _spawn(out: Path, phase: str) -> dict[str, bool]:
    start_ranks(_worker, (free_port(), str(out), phase), WORLD)
    results = [json.loads(Path(out, f"{phase}.rank{r}.json").read_text()) for r in range(WORLD)]
    return {k: all(r[k] for r in results) for k in results[0]}


def test_fsdp2_dcp_resume_in_fresh_processes_is_bitwise(tmp_path):
    assert all(_spawn(tmp_path, "save").values())
    resumed = _spawn(tmp_path, "load")
    assert resumed == {f"{n}-{d}": True for n, d in COMBOS} | {"weights_only_differs": True}
