"""One tenant of the isolation test, in its own process through the pinned SDK:
``python -m tests.service.tenant_client URL ROLE OUT [BOB_PATH]`` (key in ``TINKER_API_KEY``).

- ``bob``: trains ``STEPS`` steps, saves its state as ``bk``; writes its losses, model id
  and checkpoint path to ``OUT``.
- ``alice``: trains a step, saves a training state ``t`` and sampler weights ``s``, writes
  their paths to ``OUT.ready`` and waits for ``OUT.go`` (the test truncates ``t`` meanwhile);
  then tries four loads that must be refused (bob's path twice, the truncated state, the
  sampler weights with optimizer), training a step after each; writes its losses, model id
  and each refusal's category and message to ``OUT``.
- ``alice-plain``: alice's training steps and saves without the refused loads.

Every tenant waits for ``OUT.go`` before training, so the two train at the same time; bob
and alice-plain submit all their rounds at once, so the server batches their rows together
when batching across tenants is on."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import tinker
from tinker import types

from tests.service.helpers import (
    BASE_MODEL,
    examples,
    losses_of,
    run_and_exit,
    stop_sdk_thread,
    train_step,
)

STEPS = 6
LR = 1e-3
WAIT_S = 120.0


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {WAIT_S} s")
        time.sleep(0.01)


def bob(sc: tinker.ServiceClient, out: Path) -> dict:
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=21).result()
    data = examples(tc.get_tokenizer(), 4, start=50)
    Path(f"{out}.ready").touch()
    wait_for(Path(f"{out}.go"))
    losses = pipelined(tc, [data[k % 3 :] for k in range(STEPS)], weight_decay=0.01)
    return {"losses": losses, "model_id": tc.model_id, "path": tc.save_state("bk").result().path}


def pipelined(tc: tinker.TrainingClient, batches: list[list[types.Datum]], **adam: float,
              ) -> list[float]:  # fmt: skip
    """Every round submitted before any result is read (so the server holds this tenant's
    requests while the other tenant's arrive: batches across tenants form); the losses."""
    adam = {"learning_rate": LR, **adam}
    rounds = [(tc.forward_backward(b, "cross_entropy"), tc.optim_step(types.AdamParams(**adam)))
              for b in batches]  # fmt: skip
    losses = []
    for fb, step in rounds:
        losses.append(losses_of(fb.result()))
        step.result()
    return losses


def alice(sc: tinker.ServiceClient, out: Path, bob_path: str, refuse: bool) -> dict:
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    data = examples(tc.get_tokenizer(), 2)
    losses = [train_step(tc, data, learning_rate=LR)]
    truncated = tc.save_state("t").result().path
    sampler = tc.save_weights_for_sampler("s").result().path
    Path(f"{out}.ready").write_text(json.dumps({"truncated": truncated, "sampler": sampler}))
    wait_for(Path(f"{out}.go"))
    calls = {
        "other tenant's path": lambda: tc.load_state_with_optimizer(bob_path).result(),
        "truncated checkpoint": lambda: tc.load_state_with_optimizer(truncated).result(),
        "sampler with optimizer": lambda: tc.load_state_with_optimizer(sampler).result(),
        "other tenant's path, new model": lambda: sc.create_training_client_from_state(
            bob_path
        ).result(),
    }
    if not refuse:
        return {"losses": losses + pipelined(tc, [data] * len(calls)), "model_id": tc.model_id}
    refusals = {}
    for label, call in calls.items():
        try:
            call()
            refusals[label] = {"category": "none", "message": "accepted"}
        except tinker.RequestFailedError as exc:
            refusals[label] = {"category": str(exc.category.value), "message": str(exc)}
        losses.append(
            train_step(tc, data, learning_rate=LR)
        )  # and alice trains on between her refused loads
    return {"losses": losses, "model_id": tc.model_id, "refusals": refusals}


def main(url: str, role: str, out: str, bob_path: str = "") -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=os.environ["TINKER_API_KEY"])
    if role == "bob":
        result = bob(sc, Path(out))
    else:
        result = alice(sc, Path(out), bob_path, refuse=role == "alice")
    Path(out).write_text(json.dumps(result))
    # No session finish: the models stay in their slots for the test to read (the server
    # expires the session after serve.session_timeout_s without heartbeats).
    stop_sdk_thread([sc])


if __name__ == "__main__":
    run_and_exit(lambda: main(*sys.argv[1:]))
