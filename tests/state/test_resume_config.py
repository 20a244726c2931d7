"""Which config differences a full resume refuses: keys that change the run's result,
not keys that only change how it is computed, nor keys an older checkpoint predates."""

from __future__ import annotations

from dataclasses import asdict

from veoptim.objectives import SFTConfig
from veoptim.state.run_config import RESUME_MUST_MATCH, config_differences


def configs() -> tuple[dict, dict, dict]:
    saved, live, defaults = asdict(SFTConfig()), asdict(SFTConfig()), asdict(SFTConfig())
    return saved, live, defaults


def test_result_changing_keys_are_refused():
    saved, live, defaults = configs()
    live["train"]["seed"] = 7
    live["model"]["hidden_size"] = 128
    diffs = config_differences(saved, live, RESUME_MUST_MATCH, defaults)
    assert [d.split(":")[0] for d in diffs] == ["model.hidden_size", "train.seed"]


def test_how_it_is_computed_may_change():
    saved, live, defaults = configs()
    live["model"]["activation_checkpointing"] = True
    live["model"]["attn_implementation"] = "eager"
    live["data"]["eval_path"] = "held_out.jsonl"
    assert config_differences(saved, live, RESUME_MUST_MATCH, defaults) == []


def test_a_key_the_checkpoint_predates_matches_its_default_only():
    saved, live, defaults = configs()
    del saved["train"]["epochs"], saved["data"]["eval_fraction"]
    assert config_differences(saved, live, RESUME_MUST_MATCH, defaults) == []
    live["train"]["epochs"] = 3
    diffs = config_differences(saved, live, RESUME_MUST_MATCH, defaults)
    assert diffs == ["train.epochs: saved '<absent>', live 3"]
    # without the defaults (weights-only and older callers) an absent key is a difference
    live["train"]["epochs"] = 0
    assert config_differences(saved, live, RESUME_MUST_MATCH) != []
