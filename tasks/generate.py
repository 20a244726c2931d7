"""Answer prompts with an export: an HF or merged export, or a base plus a PEFT adapter.

    veoptim-generate runs/sft/exports/hf_final --prompt "What is 12+30?"
    veoptim-generate runs/lora/exports/lora_final --prompts prompts.jsonl --format jsonl
    python -m tasks.generate MODEL [--adapter ADAPTER] [--prompt TEXT ...] [--prompts FILE]
        [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--format text|jsonl]

MODEL is a Hugging Face model directory (an hf or merged export) or a PEFT adapter
directory (its adapter_config.json names the base; --adapter gives an adapter for MODEL
instead). Each prompt is a user turn rendered with the tokenizer's chat template (a JSONL
file: {"prompt": "..."} or {"messages": [...]} per line); --no-chat-template feeds raw
text. Decoding is greedy unless --temperature > 0 (then sampled with --top-p, from
--seed). Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from veoptim.distributed.log import disable_library_progress_bars
from veoptim.errors import VeoptimError
from veoptim.export.generate import DTYPES, GenerateOptions, generate, load_model, read_prompts


def parser() -> argparse.ArgumentParser:
    """The command line (exit status 2 on a usage error, like every other error)."""
    p = argparse.ArgumentParser(
        prog="veoptim-generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="HF/merged export directory, or a PEFT adapter directory")
    p.add_argument("--adapter", help="a PEFT adapter directory to apply to MODEL")
    p.add_argument("--prompt", action="append", default=[], help="a user turn (repeatable)")
    p.add_argument("--prompts", help="a JSONL file of prompts ('prompt' or 'messages' per line)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with temperature)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--no-chat-template", action="store_true", help="prompts are raw text")
    p.add_argument("--format", choices=("text", "jsonl"), default="text",
                   help="text: one reply per prompt; jsonl: prompt, completion, token_ids")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--allow-other-base",
        action="store_true",
        help="apply the adapter even if MODEL differs from the base it was trained on "
        "(refused by default)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Generate; 0 on success, 2 with a one-line error otherwise."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    disable_library_progress_bars()  # transformers' "Loading weights" bar of every load
    options = GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=not args.no_chat_template,
    )
    try:
        options.check()
        prompts = [*args.prompt, *(read_prompts(args.prompts) if args.prompts else [])]
        if not prompts:
            raise VeoptimError("no prompts: pass --prompt TEXT or --prompts FILE.jsonl.")
        model, tokenizer = load_model(args.model, args.adapter, args.dtype, args.device,
                                      allow_other_base=args.allow_other_base)  # fmt: skip
        completions = generate(model, tokenizer, prompts, options)
    except (VeoptimError, OSError, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    for completion in completions:
        if args.format == "jsonl":
            print(json.dumps(completion.to_json(), ensure_ascii=False))
        else:
            print(completion.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
