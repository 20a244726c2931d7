"""How a load installs model weights and optimizer state into the live objects.

Where it is exactly what DCP's ``set_model_state_dict`` / ``set_optimizer_state_dict``
would do, a load copies the staged weights into the parameters' own memory and hands the
optimizer its state by position, skipping DCP's re-derivation of every parameter's name.
Checked against the DCP route on real trainers, bitwise, for full fine-tuning and LoRA;
a module with its own load hook, a state dict that is not the module's memory and
reordered optimizer groups keep the DCP route. (FSDP2 and expert-parallel loads on 2 and
4 ranks take the direct route too: ``test_reshard.py``.)
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import veoptim.lora.state as lora_state
import veoptim.state.model as model_state
from tests.checkpoint.ckpt_state import assert_bitwise_equal, build_trainer, load_with, snapshot
from tests.checkpoint.helpers.sft_jobs import counting_dcp_installs
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.state.model import copy_installer
from veoptim.state.optimizer import OptimizerState, trainable_named_params

DCP_BOTH = ["set_model_state_dict", "set_optimizer_state_dict"]
LORA = ["lora.enabled=true", "lora.r=4", "optim=master_fp32_adamw"]


def _force_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (model_state, lora_state):
        monkeypatch.setattr(module, "copy_installer", lambda *args: None)
    monkeypatch.setattr(OptimizerState, "_state_dict_by_position", lambda *args: None)


@pytest.fixture(scope="module", params=[[], LORA], ids=["full", "lora"])
def saved(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    writer = build_trainer(base / "writer", request.param)
    for _ in range(2):
        writer.train_step()
    root = base / "ckpt"
    writer.checkpointer = Checkpointer(root, fsync=False)
    writer.save_checkpoint("good")
    return request.param, root, snapshot(writer)


def _load(tmp_path, overrides, root):
    reader = build_trainer(tmp_path, overrides)
    params = {n: (p, p.data_ptr()) for n, p in reader.model.named_parameters()}
    with counting_dcp_installs() as dcp_installs:
        load_with(Checkpointer(root, fsync=False), reader, "good")
    after = dict(reader.model.named_parameters())
    in_place = all(after[n] is p and p.data_ptr() == ptr for n, (p, ptr) in params.items())
    return snapshot(reader), dcp_installs, in_place


def test_direct_install_is_bitwise_the_dcp_install(saved, tmp_path, monkeypatch):
    overrides, root, written = saved
    direct, installs, in_place = _load(tmp_path / "direct", overrides, root)
    assert installs == [] and in_place
    _force_dcp(monkeypatch)
    through_dcp, installs, _ = _load(tmp_path / "dcp", overrides, root)
    assert installs == DCP_BOTH  # negative control: the spy sees the DCP route
    for restored in (direct, through_dcp):
        assert_bitwise_equal(
            {k: v for k, v in restored.items() if k != "rng"},
            {k: v for k, v in written.items() if k != "rng"},
        )
    assert_bitwise_equal(direct, through_dcp)


def test_a_module_load_hook_keeps_the_dcp_install(saved, tmp_path):
    overrides, root, written = saved
    reader = build_trainer(tmp_path, overrides)
    seen = []
    norm = next(m for n, m in reader.model.named_modules() if n.endswith("model.norm"))
    norm.register_load_state_dict_post_hook(lambda module, keys: seen.append(module))
    with counting_dcp_installs() as installs:
        load_with(Checkpointer(root, fsync=False), reader, "good")
    assert installs == DCP_BOTH[:1] and len(seen) == 1  # the hook ran, through DCP
    assert_bitwise_equal(snapshot(reader)["params"], written["params"])


def test_a_state_dict_that_is_not_the_modules_memory_keeps_the_dcp_install(tmp_path):
    model = build_trainer(tmp_path).model
    live = get_model_state_dict(model)
    staged = {fqn: torch.empty_like(t) for fqn, t in live.items()}
    assert copy_installer(model, live, staged) is not None
    copied = {**live, "model.norm.weight": live["model.norm.weight"].clone()}
    assert copy_installer(model, copied, staged) is None


def test_reordered_optimizer_groups_keep_the_dcp_install(tmp_path):
    trainer = build_trainer(tmp_path)
    trainer.train_step()
    state = OptimizerState(trainer.model, trainer.optimizer, layout=None)
    names = {id(p): n for n, p in trainable_named_params(trainer.model, trainer.optimizer)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in trainer.optimizer.param_groups
    ]
    assert state._state_dict_by_position({}, groups) is not None
    biggest = max(groups, key=lambda g: len(g["params"]))
    biggest["params"][:2] = biggest["params"][1::-1]
    assert state._state_dict_by_position({}, groups) is None
