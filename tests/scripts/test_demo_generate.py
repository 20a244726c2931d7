"""The demo's generation step runs on a trained export and prints one line per prompt."""

from __future__ import annotations

from callbacks.hf_export import EXPORTS_SUBDIR, HF_EXPORT_NAME, HFExportCallback
from scripts.demo_generate import held_out_pairs, main, training_prompts
from tests.checkpoint.ckpt_state import build_trainer
from veoptim.checkpoint import resolve


def test_held_out_prompts_are_not_in_the_training_file():
    pairs = held_out_pairs(20)
    assert len({p for p, _ in pairs}) == 20
    assert not {p for p, _ in pairs} & training_prompts()
    assert all(answer for _, answer in pairs)


def test_demo_prints_prompt_answer_and_expected_for_each_prompt(tmp_path, capsys):
    trainer = build_trainer(tmp_path, ["train.max_steps=2", "model.dtype=fp32"])
    trainer.train()
    HFExportCallback(trainer.cfg.export, fsync=False).on_train_end(trainer)
    export = trainer.run_dir / EXPORTS_SUBDIR / HF_EXPORT_NAME
    assert resolve(export.parent, export.name)
    assert main([str(export), "-n", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "expected:" in line]
    prompts = [p for p, _ in held_out_pairs(3)]
    assert len(lines) == 3
    for line, prompt in zip(lines, prompts, strict=True):
        assert prompt in line and "answer:" in line


def test_demo_refuses_a_directory_that_is_not_an_export(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_the_demos_answers_are_what_veoptim_generate_prints(tmp_path, capsys, monkeypatch):
    import scripts.demo_generate as demo
    from tasks.generate import main as generate_main
    from veoptim.export import generate as library

    trainer = build_trainer(tmp_path, ["train.max_steps=2", "model.dtype=fp32"])
    trainer.train()
    HFExportCallback(trainer.cfg.export, fsync=False).on_train_end(trainer)
    export = str(trainer.run_dir / EXPORTS_SUBDIR / HF_EXPORT_NAME)
    calls = []
    monkeypatch.setattr(
        demo, "generate", lambda *a, **k: calls.append(a) or library.generate(*a, **k)
    )
    assert main([export, "-n", "3"]) == 0
    assert calls  # the demo decodes through veoptim.export.generate
    demo_answers = [
        line.split("answer: ")[1].split(" expected:")[0].strip()
        for line in capsys.readouterr().out.splitlines()
        if "expected:" in line
    ]
    prompts = [arg for p, _ in held_out_pairs(3) for arg in ("--prompt", p)]
    assert generate_main([export, *prompts, "--max-new-tokens", "16"]) == 0
    assert demo_answers == [repr(line) for line in capsys.readouterr().out.splitlines()]
