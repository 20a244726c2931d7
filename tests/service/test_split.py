"""A batch the SDK splits (here above serve.max_datums=2 datums per request) arrives as
concurrent requests, the first chunk last: the server runs them in seq_id order, and each
chunk's log-probabilities are those of a direct pass over that chunk, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.service.helpers import BASE_MODEL, InProcessServer, examples
from tests.service.test_exact import bits, direct_batch
from veoptim.slots.tokens import forward_tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_a_split_batch_runs_in_seq_id_order(tmp_path):
    srv = InProcessServer(tmp_path / "serve", "serve.max_datums=2")
    try:
        sc = srv.client("alice")
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        data = examples(tc.get_tokenizer(), 5)
        result = tc.forward(data, "cross_entropy").result()
        lines = [json.loads(x) for x in (srv.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["datums"] for x in lines if x["op"] == "forward"] == [2, 2, 1]
        slot = srv.slot_of(tc.model_id)
        chunks = [data[0:2], data[2:4], data[4:5]]
        direct = [forward_tokens(srv.trainer, direct_batch(c, slot)).logprobs for c in chunks]
        expected = [d[i, : c[i].model_input.length].numpy() for c, d in zip(chunks, direct, strict=True)
                    for i in range(len(c))]  # fmt: skip
        got = [o["logprobs"].to_numpy() for o in result.loss_fn_outputs]
        assert len(got) == 5
        assert all(np.array_equal(bits(g), bits(e)) for g, e in zip(got, expected, strict=True))
        sc.close("success").result()
    finally:
        srv.close()
