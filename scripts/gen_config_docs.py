"""Print the config reference (docs/config.md) generated from the structured-config dataclasses.

A test regenerates it and compares with the committed file, so the reference
never drifts from the code: run `make docs` after changing a field. The page's prose (the
header, and the closing section on writing your own config files) lives here too.
"""

from __future__ import annotations

from veoptim.config.reference import config_keys, sections, task_sections
from veoptim.objectives import DPOConfig, SFTConfig
from veoptim.service.config import ServeConfig
from veoptim.slots import MultiLoRAConfig

HEADER = """# Config reference

Generated from the config dataclasses (`veoptim/config/schema.py` and the SFT
task's `veoptim/objectives/schema.py`) by `scripts/gen_config_docs.py`
(`make docs`); a test fails when this page and the dataclasses disagree.
Override any key on the command line: `python -m tasks.sft optim.lr=1e-4`.
`tasks.dpo`, `tasks.multi_lora` and `tasks.serve` share every section and change the ones
listed at the end.
Choose a config group file with `group=name` (e.g. `optim=master_fp32_adamw`,
`model=tiny_moe`, `parallel=fsdp`, `scheduler=wsd`); the files live under
`configs/<group>/`. To keep settings in a file of your own, see
[your own config files](#your-own-config-files) at the end.
"""

OWN_CONFIGS = """
## Your own config files

A config file of your own is a primary config in a directory you pass with `--config-dir`
(relative to where you run the command, or absolute), named with `--config-name` (the file
name without `.yaml`). Overrides, sweeps and `torchrun` work as with the shipped configs:

```bash
python -m tasks.sft --config-dir my_configs --config-name mine                 # my_configs/mine.yaml
python -m tasks.sft --config-dir my_configs --config-name mine optim.lr=1e-3
python -m tasks.sft --config-dir my_configs --config-name mine -m optim.lr=1e-3,3e-3   # runs/mine/0, /1
```

The shortest one starts from the shipped task config and sets what differs:

```yaml
# my_configs/mine.yaml
defaults:
  - sft          # configs/sft.yaml: the task's schema, its groups' defaults
  - _self_       # this file's values win over those of sft.yaml
run:
  dir: runs/mine
train:
  max_steps: 200
optim:
  lr: 1.0e-3
```

Or list the schema and the groups yourself, as `configs/sft.yaml` does:

```yaml
# my_configs/mine.yaml
defaults:
  - sft_schema          # first: the task's schema (dpo_schema, multi_lora_schema, serve_schema)
  - model: tiny_dense   # an option of each group: configs/<group>/ or my_configs/<group>/
  - optim: adamw
  - scheduler: cosine
  - parallel: single
  - _self_
run:
  dir: runs/mine
train:
  max_steps: 200
```

A group option of your own goes beside it: `my_configs/optim/my_adamw.yaml` holds keys of
the `optim` section (`name: adamw`, `lr: 1.0e-3`, without an `optim:` line) and is chosen
with `- optim: my_adamw` or `optim=my_adamw`. A recipe written like the shipped ones
(`configs/recipes/*.yaml`: `# @package _global_` on the first line, the groups named with a
leading `/`, as in `- /sft_schema` and `- /model: hf_local`) can live in
`my_configs/recipes/my_recipe.yaml` and runs with `--config-name recipes/my_recipe`.

- The run writes into its `run.dir`, and a sweep's jobs into `<run.dir>/0`, `/1`, ...,
  whether or not the file has the `hydra:` block of `configs/sft.yaml`: the command points
  Hydra's run and sweep dirs at `run.dir` (unless the command line sets `hydra.run.dir` or
  `hydra.sweep.dir`) and gives Hydra's own log lines veoptim's format (unless the file chose
  another `hydra/job_logging`). The file needs no `hydra:` block.
- Hydra looks in `configs/` before `--config-dir`: a file of yours named like a shipped one
  (`sft`, `optim/adamw`) is never read, so give yours names of their own.
- A mistake in the file gets what a mistake on the command line gets: one line, exit
  status 2, before anything runs, naming the file, the line and the key, with the closest
  known key, the group's valid options or the expected type; a YAML syntax error names the
  file and its line. For example:
  `error: unknown config key train.max_stepz (my_configs/mine.yaml:8: max_stepz: 200): SFTConfig declares no such key; did you mean train.max_steps? (python -m tasks.sft --help lists every key)`.
- `--help` with `--config-dir` and `--config-name` lists every key with your file's values as
  the defaults; `run.dry_run=true` checks the whole run without training it.
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
        "Its config (`veoptim/slots/config.py`) replaces `data` and adds `slots`; "
        "`lora.num_slots` and `lora.r` (each slot's maximum rank) matter there.",
        MultiLoRAConfig,
    )
    out += _task_sections(
        "tasks.serve",
        "Its config (`veoptim/service/config.py`) is the multi-LoRA config (each training "
        "client is a slot) plus `serve`; see docs/service.md.",
        ServeConfig,
    )
    out.append(OWN_CONFIGS)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
