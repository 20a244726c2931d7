"""Print the config reference (docs/config.md) generated from the structured-config dataclasses.

A test regenerates it and compares with the committed file, so the reference
never drifts from the code: run `make docs` after changing a field.
"""

from __future__ import annotations

import dataclasses
import typing

from veoptim.config.schema import TrainerConfig
from veoptim.lora.slots import MultiLoRAConfig
from veoptim.objectives import DPOConfig, SFTConfig

HEADER = """# Config reference

Generated from the config dataclasses (`veoptim/config/schema.py` and the SFT
task's `veoptim/objectives/sft.py`) by `scripts/gen_config_docs.py`
(`make docs`); a test fails when this page and the dataclasses disagree.
Override any key on the command line: `python -m tasks.sft optim.lr=1e-4`.
`tasks.dpo` and `tasks.multi_lora` share every section and change the ones listed at the end.
Choose a config group file with `group=name` (e.g. `optim=master_fp32_adamw`,
`model=tiny_moe`, `parallel=fsdp`, `scheduler=wsd`); the files live under
`veoptim/configs/<group>/`.
"""


def _type_name(tp: object) -> str:
    text = getattr(tp, "__name__", None) or str(tp)
    return str(tp) if "[" in str(tp) else text


def _rows(cls: type, prefix: str) -> list[str]:
    rows: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows += _rows(tp, key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(d) for d in default]
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{key}` | `{_type_name(tp)}` | `{default!r}` | {help_text} |")
    return rows


def _task_sections(task: str, intro: str, config: type) -> list[str]:
    """The sections of a task's config that differ from the shared ones."""
    out = [f"\n## `{task}`\n", intro]
    shared = typing.get_type_hints(TrainerConfig)
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if shared.get(f.name) is hints[f.name]:
            continue
        out.append(f"\n### `{f.name}`\n")
        out.append("| key | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        out += _rows(hints[f.name], f"{f.name}.")
    return out


def render() -> str:
    out = [HEADER]
    hints = typing.get_type_hints(SFTConfig)
    for f in dataclasses.fields(SFTConfig):
        out.append(f"\n## `{f.name}`\n")
        out.append("| key | type | default | meaning |")
        out.append("| --- | --- | --- | --- |")
        out += _rows(hints[f.name], f"{f.name}.")
    out += _task_sections(
        "tasks.dpo",
        "Its config (`veoptim/objectives/dpo.py`) replaces `data` and adds `dpo`.",
        DPOConfig,
    )
    out += _task_sections(
        "tasks.multi_lora",
        "Its config (`veoptim/lora/slots/config.py`) replaces `data` and adds `slots`; "
        "`lora.num_slots` and `lora.r` (each slot's maximum rank) matter there.",
        MultiLoRAConfig,
    )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
