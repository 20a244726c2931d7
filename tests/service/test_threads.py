"""The server's thread count (``serve.threads``) and the scheduler's config keys: auto
gives each rank its share of the usable cores and honours ``OMP_NUM_THREADS``; an explicit
setting wins; bad values are refused in one line before anything loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tasks.compose import load_config
from veoptim.errors import ConfigError
from veoptim.service.threads import server_threads

pytestmark = pytest.mark.starts_processes


@pytest.mark.parametrize(
    ("setting", "env", "cores", "want"),
    [
        (0, {}, 2, 2),  # this VM: both cores
        (0, {}, 16, 16),
        (0, {"LOCAL_WORLD_SIZE": "4"}, 16, 4),
        (0, {"LOCAL_WORLD_SIZE": "8"}, 8, 1),
        (0, {"LOCAL_WORLD_SIZE": "4"}, 2, 1),  # more ranks than cores: one each, never 0
        (0, {}, 1, 1),
        (0, {"OMP_NUM_THREADS": "6"}, 16, 6),
        (3, {"OMP_NUM_THREADS": "6"}, 16, 3),
        (0, {"OMP_NUM_THREADS": ""}, 4, 4),
    ],
)
def test_server_threads(setting, env, cores, want):
    assert server_threads(setting, env, cores)[0] == want


def test_the_server_process_runs_on_the_threads_it_chose(tmp_path):
    """In a new interpreter without OMP_NUM_THREADS, apply_server_threads sets torch's
    intra-op threads (and one inter-op thread) to the auto choice."""
    code = (
        "import torch, os\n"
        "from veoptim.service.threads import apply_server_threads, server_threads, usable_cores\n"
        "want = server_threads(0, os.environ, usable_cores())[0]\n"
        "got = apply_server_threads(0)\n"
        "print(want, got, torch.get_num_threads(), torch.get_num_interop_threads())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    want, got, intra, inter = map(int, out)
    assert want == got == intra and inter == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("serve.schedule=roundrobin", "serve.schedule must be one of fair, fifo, got 'roundrobin'"),
        ("serve.threads=-1", "serve.threads must be >= 0 (0 = auto), got -1"),
        ("serve.max_batch_rows=0", "serve.max_batch_rows must be >= 1, got 0"),
        ("serve.slice_s=-0.1", "serve.slice_s must be >= 0 (0 = no slices), got -0.1"),
        ("serve.slice_s=nan", "serve.slice_s must be >= 0 (0 = no slices), got nan"),
    ],
)
def test_bad_scheduler_keys_are_refused(override, message):
    config = load_config("serve", [override])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.check_serve_keys()
