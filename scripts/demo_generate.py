"""Answer held-out prompts of the bundled tasks with an exported model (what ``make demo`` shows).

    .venv/bin/python -m scripts.demo_generate runs/sft/exports/hf_final [-n 8]

The prompts come from the bundled task generator (``scripts/make_assets.py``) with
another seed, minus every prompt of the training file, so the answers show what
the model learned rather than what it memorised. The answers are what
``veoptim-generate EXPORT --prompt ...`` prints (``veoptim.export.generate``): the chat
template, then greedy ``transformers`` ``generate``, token for token what plain
``AutoModelForCausalLM`` + ``AutoTokenizer`` give (the export needs nothing from veoptim).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from scripts.make_assets import make_turn
from veoptim.data.paths import ASSETS_DIR, SFT_TRAIN_FILE
from veoptim.export.generate import GenerateOptions, generate, load_model

HELD_OUT_SEED = 777  # make_assets.py trains on SEED = 20240531


def training_prompts(path: Path = ASSETS_DIR / SFT_TRAIN_FILE) -> set[str]:
    """Every user turn of the training file."""
    prompts = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        for message in json.loads(line)["messages"]:
            if message["role"] == "user":
                prompts.add(message["content"])
    return prompts


def held_out_pairs(count: int, seed: int = HELD_OUT_SEED) -> list[tuple[str, str]]:
    """``count`` distinct (prompt, expected answer) pairs absent from the training file."""
    seen, rng, pairs = training_prompts(), random.Random(seed), []
    for _ in range(100_000):
        prompt, answer = make_turn(rng)
        if prompt not in seen:
            seen.add(prompt)
            pairs.append((prompt, answer))
            if len(pairs) == count:
                return pairs
    raise RuntimeError(f"found only {len(pairs)} held-out prompts")


def answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    """The model's greedy reply to each user turn (``veoptim-generate``'s decoding)."""
    options = GenerateOptions(max_new_tokens=max_new_tokens)
    return [c.text for c in generate(model, tokenizer, prompts, options)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="an HF export directory, e.g. runs/sft/exports/hf_final")
    parser.add_argument("-n", "--num", type=int, default=8, help="held-out prompts to answer")
    args = parser.parse_args(argv)
    path = Path(args.export)
    if not (path / "config.json").is_file():
        print(f"error: {path} is not a Hugging Face model directory (no config.json).", file=sys.stderr)  # fmt: skip
        return 2
    model, tokenizer = load_model(path)
    pairs = held_out_pairs(args.num)
    replies = answers(model, tokenizer, [prompt for prompt, _ in pairs])
    width = max(len(p) for p, _ in pairs)
    correct = 0
    print(f"held-out prompts (not in the training data), greedy answers of {path}:")
    for (prompt, expected), reply in zip(pairs, replies, strict=True):
        correct += reply == expected
        mark = "ok" if reply == expected else "--"
        print(f"{mark} {prompt:<{width}}  answer: {reply!r:<14} expected: {expected!r}")
    print(f"{correct}/{len(pairs)} exactly right")
    return 0


if __name__ == "__main__":
    sys.exit(main())
