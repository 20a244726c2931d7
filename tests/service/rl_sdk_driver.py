"""``python -m scripts.rl_sdk ARGS`` ended the way test client processes end
(:func:`tests.service.helpers.run_and_exit`: the SDK's loop stopped, then ``os._exit``)."""

from __future__ import annotations

import sys

from scripts import rl_sdk
from tests.service.helpers import run_and_exit

if __name__ == "__main__":
    run_and_exit(lambda: rl_sdk.main(sys.argv[1:]))
