"""RL on the cookbook's arithmetic problems with the plain ``tinker`` SDK and one of the
server's own RL losses (``ppo`` or ``cispo``).

    TINKER_API_KEY=tml-... .venv/bin/python -m scripts.rl_sdk \\
        --base-url http://127.0.0.1:8000 --model $PWD/veoptim/assets/tokenizer \\
        --log-path runs/rl_sdk --loss ppo --steps 16 --seed 0

Each step: a sampling client of the current weights
(``save_weights_and_get_sampling_client``), ``--groups`` problems ``What is x + y?``
(``x``, ``y`` in 0..100, drawn from ``--seed`` and the step) each sampled ``--group-size``
times at temperature 1 behind the cookbook's few-shot prefix, in the ``role_colon``
format; every sample rewarded by the cookbook's own grader (``ArithmeticEnv.step``:
1 for the right final integer, -0.1 when the answer does not end with the stop sequence);
the advantage of a sample its reward minus its group's mean; one ``forward_backward``
with ``loss_fn`` ``--loss`` over every sample of the groups whose rewards differ (a
datum: prompt and sampled tokens, the sampler's log-probabilities and the advantage on
the sampled tokens, zeros on the prompt), then one ``optim_step``. Sampling is seeded
(from ``--seed``, the step and the group) and so is the adapter, so a run repeats.

``LOG_PATH/metrics.jsonl`` gets one line per step with the recipe's names
(``env/all/reward/total``, ``env/all/correct``, ``env/all/format``), which
``scripts/plot_rl.py`` plots beside the recipe's. ``--model`` is the served model's name
(``serve.base_model``); the prompts are tokenized with the tokenizer in that directory, as
the cookbook does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.tokenizer_utils import get_tokenizer

LOSSES = ("ppo", "cispo")


def ADAM(learning_rate: float) -> types.AdamParams:  # noqa: N802
    """The cookbook RL recipe's Adam settings."""
    return types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)


@dataclass(frozen=True)
class Options:
    base_url: str
    model: str
    log_path: Path
    loss: str = "ppo"
    steps: int = 16
    groups: int = 8
    group_size: int = 8
    learning_rate: float = 1e-2
    max_tokens: int = 12
    rank: int = 8
    seed: int = 0


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server, http://HOST:PORT")
    parser.add_argument("--model", required=True, help="the served model (serve.base_model)")
    parser.add_argument("--log-path", required=True, type=Path, help="metrics.jsonl goes here")
    parser.add_argument("--loss", choices=LOSSES, default=Options.loss)
    parser.add_argument("--steps", type=int, default=Options.steps)
    parser.add_argument("--groups", type=int, default=Options.groups, help="problems per step")
    parser.add_argument("--group-size", type=int, default=Options.group_size,
                        help="samples per problem")  # fmt: skip
    parser.add_argument("--learning-rate", type=float, default=Options.learning_rate)
    parser.add_argument("--max-tokens", type=int, default=Options.max_tokens)
    parser.add_argument("--rank", type=int, default=Options.rank, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=Options.seed)
    args = parser.parse_args(argv)
    return Options(args.base_url, args.model, args.log_path, args.loss, args.steps, args.groups,
                   args.group_size, args.learning_rate, args.max_tokens, args.rank, args.seed)  # fmt: skip


def problems(seed: int, step: int, count: int) -> list[tuple[int, int]]:
    """The step's ``(x, y)`` pairs, as the cookbook's arithmetic dataset draws them."""
    rng = np.random.RandomState([seed, step])
    return [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(count)]


def grade(env: ArithmeticEnv, tokens: list[int]) -> tuple[float, dict[str, float]]:
    """The cookbook's reward of one sample and its metrics (``correct``, ``format``)."""
    result = asyncio.run(env.step(tokens))
    return result.reward, dict(result.metrics)


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float,
          ) -> types.Datum:  # fmt: skip
    """Prompt and sample as one datum: targets are the next tokens, the sampler's
    log-probabilities and the advantage on the sampled tokens, zeros on the prompt."""
    full = prompt + tokens
    pad = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(full[1:], dtype=np.int64),
            "logprobs": np.asarray([0.0] * pad + logprobs, dtype=np.float32),
            "advantages": np.asarray([0.0] * pad + [advantage] * len(tokens), dtype=np.float32),
        },
    )


def rollout(sampler: tinker.SamplingClient, renderer: renderers.Renderer, opts: Options,
            step: int) -> tuple[list[types.Datum], dict[str, float]]:  # fmt: skip
    """Sample and grade the step's groups: the training data and the step's metrics."""
    envs = [ArithmeticEnv(x, y, renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
            for x, y in problems(opts.seed, step, opts.groups)]  # fmt: skip
    prompts = [
        renderer.build_generation_prompt(
            [*env.convo_prefix, {"role": "user", "content": env.get_question()}]
        )
        for env in envs
    ]
    futures = [
        sampler.sample(prompt, opts.group_size, types.SamplingParams(
            max_tokens=opts.max_tokens, temperature=1.0, stop=renderer.get_stop_sequences(),
            seed=opts.seed * 1_000_003 + step * 1_000 + g))
        for g, prompt in enumerate(prompts)
    ]  # fmt: skip
    data, rewards, correct, formats = [], [], [], []
    for env, prompt, future in zip(envs, prompts, futures, strict=True):
        sequences = future.result().sequences
        graded = [grade(env, list(seq.tokens)) for seq in sequences]
        group = np.asarray([reward for reward, _ in graded])
        rewards += group.tolist()
        correct += [metrics["correct"] for _, metrics in graded]
        formats += [metrics["format"] for _, metrics in graded]
        if np.ptp(group) == 0:  # every sample alike: no advantage, nothing to learn
            continue
        for seq, advantage in zip(sequences, group - group.mean(), strict=True):
            data.append(datum(prompt.to_ints(), list(seq.tokens), list(seq.logprobs),
                              float(advantage)))  # fmt: skip
    metrics = {"env/all/reward/total": float(np.mean(rewards)),
               "env/all/correct": float(np.mean(correct)),
               "env/all/format": float(np.mean(formats)), "datums": len(data)}  # fmt: skip
    return data, metrics


def train_step(client: tinker.TrainingClient, renderer: renderers.Renderer, opts: Options,
               step: int, out: Path) -> dict[str, float]:  # fmt: skip
    """One step: sample and grade from the current weights, then one update."""
    start = time.monotonic()
    sampler = client.save_weights_and_get_sampling_client().result()
    data, metrics = rollout(sampler, renderer, opts, step)
    if data:
        result = client.forward_backward(data, opts.loss).result()
        client.optim_step(ADAM(opts.learning_rate)).result()
        metrics["loss:sum"] = result.metrics["loss:sum"]
    row = {"step": step, **metrics, "time/step": time.monotonic() - start}
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def train(opts: Options) -> list[dict[str, float]]:
    """Run ``opts.steps`` steps; each step's metrics (also appended to metrics.jsonl)."""
    opts.log_path.mkdir(parents=True, exist_ok=True)
    out = opts.log_path / "metrics.jsonl"
    out.unlink(missing_ok=True)
    renderer = renderers.get_renderer("role_colon", tokenizer=get_tokenizer(opts.model))
    service = tinker.ServiceClient(base_url=opts.base_url)
    client = service.create_lora_training_client(
        opts.model, rank=opts.rank, seed=opts.seed
    ).result()
    rows = []
    try:
        for step in range(opts.steps):
            rows.append(train_step(client, renderer, opts, step, out))
    except BaseException:
        service.close("errored").result()
        raise
    service.close("success").result()  # the session's slots are free at once
    return rows


def main(argv: list[str] | None = None) -> None:
    train(parse(argv))


if __name__ == "__main__":
    main()
