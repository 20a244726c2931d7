"""Mistakes a new user makes that used to run silently (or fail deep inside), now refused at
startup with one sentence naming the key: unknown '+' keys, model=hf_local without a
path, a sequence length past the model's positions, a multi-rank config in one process."""

from __future__ import annotations

import pytest

from tests.conftest import compose_sft, run_sft_cli
from veoptim.config import to_config
from veoptim.distributed import init_distributed
from veoptim.errors import ConfigError
from veoptim.trainer import Trainer

pytestmark = pytest.mark.slow


def test_plus_added_unknown_key_is_rejected_with_the_closest_known_key():
    """Hydra suggests '+optim.lrr=...' after a typo; the value must not be dropped silently."""
    with pytest.raises(ConfigError, match=r"optim\.lrr.*did you mean optim\.lr\?"):
        to_config(compose_sft(["+optim.lrr=1e-3"]))
    groups = "optim.param_groups=[{pattern: norm, lr: 0.1}]"  # known keys, lists of structs
    cfg = to_config(compose_sft(["optim.lr=1e-3", groups]))
    assert cfg.optim.lr == 1e-3 and cfg.optim.param_groups[0].lr == 0.1


def test_every_unknown_key_is_named_at_any_depth():
    from veoptim.config.keys import unknown_keys

    cfg = compose_sft(["+lr=1e-3", "+export.dtpye=fp32", "+train.extra.deep=1"])
    assert sorted(key for key, _ in unknown_keys(cfg)) == [
        "export.dtpye",
        "lr",
        "train.extra",
    ]
    with pytest.raises(ConfigError) as info:
        to_config(cfg)
    message = str(info.value)
    assert "did you mean export.dtype?" in message
    assert "lr: did you mean optim.lr?" in message


def test_cli_rejects_plus_unknown_key_with_exit_code_2(tmp_path):
    proc = run_sft_cli(
        ["+optim.lrr=1e-3", f"run.dir={tmp_path / 'run'}", "train.max_steps=2"],
        tmp_path,
        fresh=True,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    output = proc.stdout + proc.stderr
    assert "error: unknown config key optim.lrr" in output
    assert "Traceback" not in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_hf_local_without_model_path_is_rejected():
    """'path: ???' merged over the schema's '' default used to leave '' (the random model)."""
    with pytest.raises(ConfigError, match=r"model\.path is required with model=hf_local"):
        to_config(compose_sft(["model=hf_local"]))


def test_max_seq_len_beyond_the_built_models_positions_is_rejected():
    with pytest.raises(ConfigError, match=r"data\.max_seq_len \(1024\).*max_position_embeddings"):
        to_config(compose_sft(["data.max_seq_len=1024"]))
    assert to_config(compose_sft(["data.max_seq_len=512"])).data.max_seq_len == 512


@pytest.mark.parametrize(
    ("group", "ranks"), [("single", 1), ("fsdp", 1), ("fsdp_ep2", 2), ("cuda_16rank", 16)]
)
def test_min_world_size_of_the_shipped_parallel_configs(group, ranks):
    from veoptim.config.launch import min_world_size

    assert min_world_size(to_config(compose_sft([f"parallel={group}"])).parallel) == ranks


def test_expert_parallel_config_in_one_process_says_to_use_torchrun(tmp_path):
    cfg = to_config(compose_sft(["model=tiny_moe", "parallel=fsdp_ep2", f"run.dir={tmp_path}"]))
    ctx = init_distributed("cpu", "auto", {})
    with pytest.raises(
        ConfigError, match=r"single process.*torchrun --standalone --nproc_per_node 2"
    ):
        Trainer.from_config(cfg, ctx)
    from veoptim.config.launch import check_launch

    check_launch(cfg.parallel, world_size=2)  # under torchrun: no complaint


def test_cli_expert_parallel_in_one_process_prints_a_ready_torchrun_command(tmp_path):
    run = f"run.dir={tmp_path / 'run'}"
    proc = run_sft_cli(["model=tiny_moe", "parallel=fsdp_ep2", run], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    expected = f"torchrun --standalone --nproc_per_node 2 -m tasks.sft model=tiny_moe parallel=fsdp_ep2 {run}"
    assert expected in proc.stdout + proc.stderr


def test_max_steps_minus_one_says_how_to_train_by_epochs(tmp_path):
    """``train.max_steps=-1`` means "by epochs" in the Hugging Face Trainer: the refusal
    says what to set instead, and what it says passes the startup checks."""
    run = f"run.dir={tmp_path / 'run'}"
    proc = run_sft_cli([run, "train.max_steps=-1"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR" in line]
    assert len(errors) == 1, errors
    assert "train.max_steps must be >= 0, got -1 (a negative value does not mean" in errors[0]
    assert "set train.epochs=N (with train.max_steps=0, the default)" in errors[0]
    hinted = run_sft_cli([run, "train.epochs=1", "train.max_steps=0", "run.dry_run=true"], tmp_path)
    assert hinted.returncode == 0, hinted.stderr[-2000:]
