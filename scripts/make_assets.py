"""Generate the bundled SFT data and tokenizer (deterministic; the outputs are committed).

    python scripts/make_assets.py            # rewrite veoptim/assets/
    python scripts/make_assets.py --check    # fail if the committed assets differ

The dataset mixes four small tasks on which a ~140k-parameter model's loss
falls clearly within a few hundred steps: addition of numbers up to 49, and
reversing, upper-casing and repeating words of a small closed vocabulary; about
a tenth of the examples are two-turn chats. Words are quoted in prompts so that
they tokenize the same way in the prompt and in the response. The tokenizer is
a byte-level BPE (vocab 512) trained on the rendered conversations.

The preference pairs (DPO) turn every SFT conversation into one pair: its context (all
but the last answer), the correct answer as ``chosen`` and a corrupted one as
``rejected`` — a sum off by 1-9, the word not reversed or reversed wrongly, the word
lower- or title-case, a repeated phrase with one word swapped or dropped: plausible near
misses, so the preference is learnable but not trivial.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import re
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from veoptim.data.chat_format import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)
from veoptim.data.paths import (
    ASSETS_DIR,
    DPO_PAIRS_FILE,
    SFT_SAMPLE_FILE,
    SFT_TRAIN_FILE,
    TOKENIZER_DIR,
)

SEED = 20240531
NUM_EXAMPLES = 3000
NUM_SAMPLE_PAIRS = 8
MULTI_TURN_FRACTION = 0.1
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 512
# A small closed vocabulary keeps the string tasks learnable by a tiny model in a few hundred steps.
WORDS = (
    "ant bat bee cat cow dog eel elk emu fox hen owl pig rat yak "
    "bear bird crab deer duck fish frog goat lion mole moth mule seal swan toad wolf "
    "apple bread cloud grape lemon melon olive plum rain snow star stone sun tree wind"
).split()
MAX_ADDEND = 49


def pick_word(rng: random.Random) -> str:
    """A lowercase word from the closed vocabulary."""
    return rng.choice(WORDS)


def make_turn(rng: random.Random) -> tuple[str, str]:
    """One (prompt, response) pair of a randomly chosen task."""
    task = rng.choice(("add", "reverse", "upper", "repeat"))
    if task == "add":
        a, b = rng.randint(0, MAX_ADDEND), rng.randint(0, MAX_ADDEND)
        return f"What is {a}+{b}?", str(a + b)
    if task == "repeat":
        words = " ".join(pick_word(rng) for _ in range(rng.randint(1, 3)))
        return f'Repeat "{words}"', words
    word = pick_word(rng)
    if task == "reverse":
        return f'Reverse "{word}"', word[::-1]
    return f'Uppercase "{word}"', word.upper()


def make_chats(rng: random.Random, count: int) -> list[list[dict[str, str]]]:
    """``count`` conversations; some have two user/assistant turns."""
    chats = []
    for _ in range(count):
        turns = 2 if rng.random() < MULTI_TURN_FRACTION else 1
        messages = []
        for _ in range(turns):
            prompt, response = make_turn(rng)
            messages += [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": response},
            ]
        chats.append(messages)
    return chats


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE: every byte is in the vocabulary, so any text round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD_TOKEN, EOS_TOKEN)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
    )
    fast.save_pretrained(out_dir)


def generate(out_dir: Path) -> None:
    """Write dataset, sample and tokenizer under ``out_dir`` (same layout as the package)."""
    rng = random.Random(SEED)
    chats = make_chats(rng, NUM_EXAMPLES)
    write_jsonl(out_dir / SFT_TRAIN_FILE, [{"messages": m} for m in chats])
    pairs = [make_turn(rng) for _ in range(NUM_SAMPLE_PAIRS)]
    write_jsonl(out_dir / SFT_SAMPLE_FILE, [{"prompt": p, "response": r} for p, r in pairs])
    write_jsonl(out_dir / DPO_PAIRS_FILE, make_pairs(out_dir / SFT_TRAIN_FILE))
    renderer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), chat_template=CHAT_TEMPLATE
    )
    texts = [renderer.apply_chat_template(m, tokenize=False) for m in chats]
    write_tokenizer(train_tokenizer(texts), out_dir / TOKENIZER_DIR)


PAIRS_SEED = 20241201
_ADD = re.compile(r"^What is (\d+)\+(\d+)\?$")
_QUOTED = re.compile(r'^(Reverse|Uppercase|Repeat) "(.+)"$')


def corrupt(prompt: str, answer: str, rng: random.Random) -> str:
    """A wrong answer to ``prompt`` close to the right one (never equal to it)."""
    if match := _ADD.match(prompt):
        total = int(match.group(1)) + int(match.group(2))
        wrong = total + rng.choice([d for d in range(-9, 10) if d and total + d >= 0])
        return str(wrong)
    match = _QUOTED.match(prompt)
    if match is None:
        raise ValueError(f"unknown bundled task prompt {prompt!r}")
    task, text = match.groups()
    candidates: list[str]
    if task == "Reverse":
        letters = list(answer)
        i = rng.randrange(len(letters) - 1)
        letters[i], letters[i + 1] = letters[i + 1], letters[i]
        candidates = [text, "".join(letters)]
    elif task == "Uppercase":
        candidates = [text, text.capitalize(), answer[:-1] + answer[-1].lower()]
    else:
        words = answer.split()
        i = rng.randrange(len(words))
        swapped = [*words[:i], rng.choice([w for w in WORDS if w != words[i]]), *words[i + 1 :]]
        candidates = [" ".join(swapped)]
        if len(words) > 1:
            candidates.append(" ".join(words[:i] + words[i + 1 :]))
    wrong = [c for c in candidates if c != answer]
    return rng.choice(wrong)


def make_pairs(sft_file: Path) -> list[dict]:
    rng = random.Random(PAIRS_SEED)
    pairs = []
    for line in sft_file.read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        *context, last = messages
        pairs.append(
            {
                "messages": context,
                "chosen": last["content"],
                "rejected": corrupt(context[-1]["content"], last["content"], rng),
            }
        )
    return pairs


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare with the committed assets")
    args = parser.parse_args()
    if not args.check:
        generate(ASSETS_DIR)
        print(f"wrote {ASSETS_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if same_tree(Path(tmp), ASSETS_DIR):
            print("assets up to date")
            return 0
    print(
        f"{ASSETS_DIR} differs from a fresh generation; run scripts/make_assets.py", file=sys.stderr
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
