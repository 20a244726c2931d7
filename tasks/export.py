"""Export a training checkpoint as a Hugging Face model directory, without a training job.

    veoptim-export runs/sft/checkpoints/step_00000500 --out runs/sft/exports --name hf_step_500
    python -m tasks.export CHECKPOINT --out ROOT --name NAME [--format hf|peft|merged|dcp|...]
        [--dtype bf16|fp32|preserve] [--max-shard-size-mb N]

The checkpoint (a name link such as <run>/checkpoints/step_00000500, or a version
directory) may come from any world size or expert-parallel layout. The result is
published atomically as <out>/<name> (kind hf_export) and loads with
AutoModelForCausalLM.from_pretrained. Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import nullcontext

from veoptim.distributed.log import disable_library_progress_bars
from veoptim.errors import VeoptimError
from veoptim.export import ExportOptions, export_checkpoint, names
from veoptim.rundir import locked_run_dir, owning_run_dir

DTYPE_CHOICES = ("bf16", "fp32", "preserve")


def parser() -> argparse.ArgumentParser:
    """The command line (exit status 2 on a usage error, like every other error)."""
    p = argparse.ArgumentParser(
        prog="veoptim-export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint name link or version directory")
    p.add_argument("--out", required=True, help="export root (created if missing)")
    p.add_argument("--name", required=True, help="export name inside --out, e.g. hf_step_500")
    p.add_argument(
        "--format",
        default="hf",
        choices=names(),
        help="hf: full model; peft: LoRA adapter directory; merged: LoRA merged into the "
        "model; dcp: the whole training checkpoint in DCP's own shard layout (torch's tools); "
        "and any format registered in veoptim.export.registry",
    )
    p.add_argument("--dtype", default="bf16", choices=DTYPE_CHOICES)
    p.add_argument("--max-shard-size-mb", type=int, default=2048)
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (scratch exports only)")
    p.add_argument(
        "--allow-other-base",
        action="store_true",
        help="peft/merged: use model.path even if its weights differ from the base the "
        "adapters were trained on (refused by default)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the export; 0 on success, 2 with a one-line error otherwise."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    disable_library_progress_bars()  # transformers' "Loading weights" bar of every load
    options = ExportOptions(
        dtype=args.dtype,
        max_shard_size_mb=args.max_shard_size_mb,
        allow_other_base=args.allow_other_base,
    )
    if args.max_shard_size_mb < 0:
        print("error: --max-shard-size-mb must be >= 0.", file=sys.stderr)
        return 2
    run_dir = owning_run_dir(args.out)  # an export into a run dir is one of its writers
    try:
        with locked_run_dir(run_dir, "this export") if run_dir else nullcontext():
            published = export_checkpoint(
                args.checkpoint, args.out, args.name,
                fmt=args.format, options=options, fsync=not args.no_fsync,
            )  # fmt: skip
    except VeoptimError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    print(f"wrote {published.path} as {args.out}/{args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
