"""sglang-router's own launcher, given its --api-key from $RADIXSERVE_ROUTER_API_KEY rather
than the command line (which `ps` shows to every user of the machine).

Run as a script (`python .../router_main.py ARGS`, fleet/router.py builds the line), not as
`-m radixserve.fleet...`: that would import radixserve, and with it torch, into the router.
So it imports nothing of radixserve; fleet/router.py takes ROUTER_API_KEY_ENV from here.
"""

from __future__ import annotations

import os
import sys

ROUTER_API_KEY_ENV = "RADIXSERVE_ROUTER_API_KEY"


def main(argv: list[str]) -> None:
    from sglang_router.launch_router import launch_router, parse_router_args

    args = list(argv)
    key = os.environ.pop(ROUTER_API_KEY_ENV, None)
    if key:
        args += ["--api-key", key]
    launch_router(parse_router_args(args))


if __name__ == "__main__":
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this folder's auth.py, router.py would shadow top-level names
    main(sys.argv[1:])
