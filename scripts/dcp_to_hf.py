"""Convert a training checkpoint to a Hugging Face model directory, without a training job.

    .venv/bin/python scripts/dcp_to_hf.py runs/sft/checkpoints/step_00000500 \\
        --out runs/sft/exports --name hf_step_500 [--dtype bf16|fp32|preserve]

The checkpoint may come from any world size or expert-parallel layout; the result
is published atomically as ``<out>/<name>`` and loads with
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import argparse
import sys

from veoptim.errors import VeoptimError
from veoptim.state.convert import convert_to_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint name link, pinned version dir or legacy dir")
    parser.add_argument("--out", required=True, help="export root (created if missing)")
    parser.add_argument("--name", required=True, help="export name inside --out")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "preserve"])
    parser.add_argument("--max-shard-size-mb", type=int, default=2048)
    args = parser.parse_args(argv)
    try:
        published = convert_to_hf(
            args.checkpoint, args.out, args.name,
            dtype=args.dtype, max_shard_size_mb=args.max_shard_size_mb,
        )  # fmt: skip
    except VeoptimError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {published.path} as {args.out}/{args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
