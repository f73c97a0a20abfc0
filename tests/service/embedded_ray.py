"""A child process that starts Ray the way `bnrecal calibrate` and `serve` do (ensure_ray
without an address), gives it work (a task and an actor, so worker processes listen too),
writes what a test needs to a file, and keeps the instance up until its stdin closes.

    python -m tests.service.embedded_ray OUT.json

The token goes to OUT.json only because the test must show the instance accepts it and
nothing else: bnrecal itself never writes or logs it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out: Path) -> None:
    """Start the embedded instance, exercise it, report, and wait for stdin to close."""
    import ray

    from bnrecal.service.run.cluster import ensure_ray

    assert ensure_ray(None, min_cpus=2), "ensure_ray did not start an embedded instance"

    @ray.remote
    def pid() -> int:
        return os.getpid()

    @ray.remote
    class Holder:
        def pid(self) -> int:
            return os.getpid()

    holder = Holder.remote()  # type: ignore[attr-defined]
    workers = {*ray.get([pid.remote() for _ in range(2)]), ray.get(holder.pid.remote())}
    from ray._raylet import AuthenticationTokenLoader

    node = ray._private.worker._global_node
    out.write_text(json.dumps({
        "gcs_address": ray.get_runtime_context().gcs_address,
        "token": AuthenticationTokenLoader.instance().get_raw_token(),  # the one this driver sends
        "session_dir": node.get_session_dir_path(),
        "workers": sorted(workers),
    }))
    sys.stdin.read()
    ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
