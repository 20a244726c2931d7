"""The SDK tests of training, exact save/load and sampling, run again on a QLoRA server:
``veoptim-serve model.quant=nf4``, every tenant's slot on one 4-bit base.

The test functions are the ones of ``test_exact.py`` and ``test_sampling.py``, collected
here a second time with this module's ``server`` (pytest resolves a fixture from the
module that collects the test); what they check is unchanged.
"""

from __future__ import annotations

import pytest

from tests.lora.qlora_helpers import nf4_layers
from tests.service.helpers import InProcessServer
from tests.service.test_exact import (  # noqa: F401 - collected here with the QLoRA server
    test_returned_logprobs_equal_a_direct_slot_trainer_pass_bitwise,
    test_save_state_and_load_with_optimizer_continue_exactly,
)
from tests.service.test_sampling import (  # noqa: F401
    test_compute_logprobs_equals_the_training_forward_at_the_snapshot,
    test_greedy_samples_equal_peft_generate_on_the_snapshot_export,
    test_save_weights_for_sampler_publishes_a_snapshot_and_a_sampler_names_it,
    test_seeded_sampling_repeats_and_a_snapshot_never_changes_with_training,
    trained,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = InProcessServer(tmp_path_factory.mktemp("qlora_serve"), "model.quant=nf4",
                             "model.dtype=fp32", "export.dtype=fp32")  # fmt: skip
    yield served
    served.close()


def test_the_server_base_is_4bit_under_every_slot(server):
    layers = nf4_layers(server.trainer.model)
    assert layers and all(".base_layer" in name for name in layers if "q_proj" in name)
    assert server.trainer.fingerprint["quant"] == "nf4"
