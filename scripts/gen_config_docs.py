"""Print the config reference (docs/config.md) generated from the structured-config dataclasses.

A test regenerates it and compares with the committed file, so the reference
never drifts from the code: run `make docs` after changing a field.
"""

from __future__ import annotations

from veoptim.config.reference import config_keys, sections, task_sections
from veoptim.lora.slots import MultiLoRAConfig
from veoptim.objectives import DPOConfig, SFTConfig
from veoptim.service.config import ServeConfig

HEADER = """# Config reference

Generated from the config dataclasses (`veoptim/config/schema.py` and the SFT
task's `veoptim/objectives/schema.py`) by `scripts/gen_config_docs.py`
(`make docs`); a test fails when this page and the dataclasses disagree.
Override any key on the command line: `python -m tasks.sft optim.lr=1e-4`.
`tasks.dpo`, `tasks.multi_lora` and `tasks.serve` share every section and change the ones
listed at the end.
Choose a config group file with `group=name` (e.g. `optim=master_fp32_adamw`,
`model=tiny_moe`, `parallel=fsdp`, `scheduler=wsd`); the files live under
`configs/<group>/`.
"""


def _table(cls: type, prefix: str) -> list[str]:
    """A Markdown table of every key of one section."""
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for k in config_keys(cls, prefix):
        help_text = k.help.replace("|", "\\|")
        out.append(f"| `{k.key}` | `{k.type}` | `{k.default!r}` | {help_text} |")
    return out


def _task_sections(task: str, intro: str, config: type) -> list[str]:
    """The sections of a task's config that differ from the shared ones."""
    out = [f"\n## `{task}`\n", intro]
    for name, cls in task_sections(config):
        out.append(f"\n### `{name}`\n")
        out += _table(cls, f"{name}.")
    return out


def render() -> str:
    out = [HEADER]
    for name, cls in sections(SFTConfig):
        out.append(f"\n## `{name}`\n")
        out += _table(cls, f"{name}.")
    out += _task_sections(
        "tasks.dpo",
        "Its config (`veoptim/objectives/schema.py`) replaces `data` and adds `dpo`.",
        DPOConfig,
    )
    out += _task_sections(
        "tasks.multi_lora",
        "Its config (`veoptim/lora/slots/config.py`) replaces `data` and adds `slots`; "
        "`lora.num_slots` and `lora.r` (each slot's maximum rank) matter there.",
        MultiLoRAConfig,
    )
    out += _task_sections(
        "tasks.serve",
        "Its config (`veoptim/service/config.py`) is the multi-LoRA config (each training "
        "client is a slot) plus `serve`; see docs/service.md.",
        ServeConfig,
    )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
