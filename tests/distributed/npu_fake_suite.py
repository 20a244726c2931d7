"""The npu path of the device abstraction, process group and RNG state, against a fake torch_npu.

Runs in an interpreter of its own (``tests/distributed/test_npu_path.py``), since the
fake renames torch's PrivateUse1 backend to ``npu`` for good (``fake_npu.py``). Each
test installs a recording ``torch.npu`` and checks both the result and the device
calls the code made: availability before use, the device count before selecting
``LOCAL_RANK``, RNG states read from and written to the right device, events on the
device's current stream.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.fake_npu import (
    FAKE_NPU_ENV,
    NPU_MODULE,
    FakeNPU,
    install_fake_npu,
    name_privateuse1_npu,
)
from veoptim.checkpoint.component import SavedComponent
from veoptim.distributed import context, init_distributed, resolve_device
from veoptim.distributed.device import accelerator, local_device
from veoptim.errors import ConfigError, DistributedError
from veoptim.state.rng import RNGState, capture_rng, restore_rng

if os.environ.get(FAKE_NPU_ENV) != "1":
    pytest.skip(
        f"renames torch's PrivateUse1 backend; run by tests/distributed/test_npu_path.py "
        f"(or with {FAKE_NPU_ENV}=1 on its own)",
        allow_module_level=True,
    )

name_privateuse1_npu()  # as importing torch_npu does: torch.device("npu") parses from here on
NPU = torch.device("npu")


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNPU:
    return install_fake_npu(monkeypatch)


# ---------------------------------------------------------------- device and torch_npu import


def test_npu_device_resolves_after_checking_availability(npu):
    assert resolve_device("npu") == NPU
    assert npu.calls == [("is_available",)]


def test_npu_that_is_not_available_is_a_clear_error(monkeypatch):
    npu = install_fake_npu(monkeypatch, available=False)
    with pytest.raises(
        DistributedError,
        match=r"run.device=npu was requested but torch.npu.is_available\(\) is False",
    ):
        resolve_device("npu")
    assert npu.calls == [("is_available",)]


def test_auto_never_picks_npu(npu):
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert npu.calls == []


@pytest.fixture
def torch_npu_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a ``torch_npu`` package with the given body and make it the one imported."""
    monkeypatch.delitem(sys.modules, NPU_MODULE, raising=False)
    monkeypatch.setattr(torch, "npu", None, raising=False)  # not registered yet; undone after
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(body: str) -> None:
        (tmp_path / NPU_MODULE).mkdir()
        (tmp_path / NPU_MODULE / "__init__.py").write_text(body)

    yield write
    sys.modules.pop(NPU_MODULE, None)


def test_explicit_import_of_torch_npu_registers_torch_npu(torch_npu_package):
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch did not import it, veoptim does, once.
    torch_npu_package(
        "import torch\n"
        "from tests.distributed.fake_npu import FakeNPU\n"
        "torch.npu = FakeNPU()\n"
        "imports = 1\n"
    )
    assert resolve_device("npu") == NPU
    accel = accelerator(NPU)
    assert accel.module is torch.npu and sys.modules[NPU_MODULE].imports == 1
    assert torch.npu.calls == [("is_available",)]


@pytest.mark.parametrize(
    "raised",
    [
        "ImportError('libhccl.so: cannot open shared object file')",  # CANN not sourced
        "OSError('libascendcl.so: cannot open shared object file')",
        "RuntimeError('Two accelerators cannot be used at the same time in PyTorch: npu and cuda')",
    ],
)
def test_broken_torch_npu_is_a_clear_error_naming_the_cause(torch_npu_package, raised):
    torch_npu_package(f"raise {raised}\n")
    with pytest.raises(DistributedError) as info:
        resolve_device("npu")
    message = str(info.value)
    assert message.startswith("run.device=npu needs the optional package torch_npu")
    assert raised.split("'")[1] in message and "docs/ascend.md" in message


def test_torch_npu_that_registers_no_device_module_is_a_clear_error(torch_npu_package):
    torch_npu_package("")
    with pytest.raises(DistributedError, match="torch_npu was imported but did not register"):
        resolve_device("npu")


def test_local_rank_selects_its_npu(npu):
    assert local_device(NPU, 3) == torch.device("npu", 3)
    assert npu.calls == [("device_count",), ("set_device", 3)]
    assert npu.current == 3


def test_local_rank_beyond_the_npu_count_is_a_clear_error(monkeypatch):
    npu = install_fake_npu(monkeypatch, device_count=8)
    with pytest.raises(
        DistributedError,
        match=r"LOCAL_RANK=8 needs at least 9 npu devices on this node, found 8; "
        r"launch at most 8 processes per node",
    ):
        local_device(NPU, 8)
    assert npu.calls == [("device_count",)], "no device is selected"


def test_device_wide_synchronize_goes_to_torch_npu(npu):
    accelerator(NPU).synchronize(torch.device("npu", 5))
    assert npu.calls == [("synchronize", 5)]


def test_npu_host_buffers_are_pinned_and_copies_non_blocking(npu, monkeypatch):
    requests: list[dict] = []
    real_empty = torch.empty

    def empty(*size, **kwargs):
        requests.append(kwargs)
        return real_empty(*size, **{**kwargs, "pin_memory": False})  # a CPU-only torch pins nothing

    monkeypatch.setattr(torch, "empty", empty)
    buf = accelerator(NPU).host_buffer(64)
    assert buf.numel() == 64 and requests == [{"dtype": torch.uint8, "pin_memory": True}]

    copies: list[bool] = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copies.append(non_blocking)
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    accelerator(NPU).copy_(buf, torch.ones(64, dtype=torch.uint8))
    assert copies == [True] and bool((buf == 1).all())


def test_events_are_recorded_on_the_devices_current_stream(npu):
    npu2 = torch.device("npu", 2)
    event = accelerator(NPU).record_event(npu2)
    assert npu.calls == [("Event", 0), ("current_stream", 2), ("event.record", 0, npu2)]
    assert event.stream.device == npu2


# ---------------------------------------------------------------- process group


def test_single_process_on_npu_uses_the_first_npu_and_hccl(npu):
    ctx = init_distributed("npu", "auto", {})
    assert (ctx.device, ctx.backend, ctx.world_size) == (torch.device("npu", 0), "hccl", 1)
    assert npu.names() == ["is_available", "device_count", "set_device"]
    assert not dist.is_initialized()


def test_npu_joins_an_hccl_group_bound_to_its_local_device(npu, monkeypatch):
    joined: dict = {}
    monkeypatch.setattr(context, "_create_store", lambda env, rank, world, timeout: "store")
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: joined.update(kw))
    env = {"WORLD_SIZE": "16", "RANK": "11", "LOCAL_RANK": "3", "MASTER_ADDR": "node0"}
    ctx = init_distributed("npu", "auto", {**env, "MASTER_PORT": "29500"})
    assert (ctx.rank, ctx.local_rank, ctx.backend) == (11, 3, "hccl")
    assert ctx.device == torch.device("npu", 3) and ctx.owns_process_group
    assert joined["backend"] == "hccl" and joined["store"] == "store"
    assert (joined["rank"], joined["world_size"]) == (11, 16)
    assert joined["device_id"] == torch.device("npu", 3)
    assert npu.calls[-1] == ("set_device", 3)


def test_nccl_on_npu_is_refused_before_any_group_is_joined(npu):
    with pytest.raises(
        ConfigError, match=r"parallel.backend=nccl does not run on device npu; use 'hccl' or 'gloo'"
    ):
        init_distributed("npu", "nccl", {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert ("set_device", 0) not in npu.calls


def test_gloo_on_npu_is_accepted(npu):
    assert init_distributed("npu", "gloo", {}).backend == "gloo"


# ---------------------------------------------------------------- RNG state


def test_npu_rng_state_round_trips_through_the_checkpoint_json(npu):
    device = torch.device("npu", 3)
    npu.rng[3] = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 42, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    saved = json.loads(json.dumps(capture_rng(device)))  # the checkpoint stores JSON
    assert saved["device"] == npu.rng[3].tolist()
    before = {i: s.clone() for i, s in npu.rng.items()}
    npu.rng[3] = torch.zeros(16, dtype=torch.uint8)  # the run went on drawing numbers
    restore_rng(saved, device)
    assert all(torch.equal(npu.rng[i], before[i]) for i in npu.rng)
    assert npu.calls == [("get_rng_state", 3), ("set_rng_state", 3)], "device 3's state, no other"


def test_rng_component_restores_the_npu_state_it_saved(npu):
    device = torch.device("npu", 1)
    component = RNGState(device, world_size=1)
    saved_state = component.state()
    assert saved_state.json_per_rank and saved_state.json["device"] == npu.rng[1].tolist()
    expected = npu.rng[1].clone()
    npu.rng[1] = torch.full((16,), 9, dtype=torch.uint8)
    saved = SavedComponent(
        name="rng",
        path=Path("ckpt"),
        json=json.loads(json.dumps(saved_state.json)),
        tensors={},
        step=1,
        world_size=1,
    )
    staged = component.stage(saved)
    assert torch.equal(npu.rng[1], torch.full((16,), 9, dtype=torch.uint8)), "stage writes nothing"
    staged.install()
    assert torch.equal(npu.rng[1], expected)


def test_host_saved_rng_leaves_the_npu_state_alone(npu):
    saved = capture_rng(torch.device("cpu"))
    assert saved["device"] is None
    restore_rng(saved, torch.device("npu", 0))
    assert npu.calls == []
