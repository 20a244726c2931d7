"""``python -m tests.service.tokenizer_client URL OUT`` (key in ``TINKER_API_KEY``, offline,
``HF_HUB_CACHE`` the server's ``serve.tokenizer_cache``): every client's
``get_tokenizer()`` encodes a text; writes each one's ids (or its error) to ``OUT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tinker

from tests.service.helpers import BASE_MODEL, run_and_exit

TEXT = "User: Uppercase word1\nAssistant: WORD1"


def main(url: str, out: str) -> None:
    sc = tinker.ServiceClient(base_url=url)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    snapshot = tc.save_weights_for_sampler("tok").result().path
    clients = {
        "training": tc,
        "save_weights_and_get_sampling_client": tc.save_weights_and_get_sampling_client().result(),
        "create_sampling_client(base_model)": sc.create_sampling_client(
            base_model=BASE_MODEL
        ).result(),
        "create_sampling_client(model_path)": sc.create_sampling_client(
            model_path=snapshot
        ).result(),
    }
    found = {}
    for name, client in clients.items():
        try:
            found[name] = client.get_tokenizer().encode(TEXT)
        except Exception as exc:  # noqa: BLE001 - the test reads which one failed, and why
            found[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    Path(out).write_text(json.dumps(found))
    sc.close("success").result()


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1], sys.argv[2]))
