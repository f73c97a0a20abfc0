"""The image definition and its entry script: both variants resolve, pins match the code's
environment, the entry script starts an API node as a full Ray driver and leaves cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.deploy.deployfiles import (
    DOCKERIGNORE,
    ENTRYPOINT,
    REPO,
    VARIANTS,
    build_image,
    dockerignore_patterns,
    dockerignored,
    dry_run,
    read_dockerfile,
)

TOKEN = {"RAY_AUTH_TOKEN": "0123456789abcdef" * 4}  # the cluster's Ray token (deploy/README.md)


def public_version(distribution: str) -> str:
    """The installed version without its local label (2.14.1+cpu -> 2.14.1)."""
    return version(distribution).split("+")[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_builds_on_the_expected_base(variant: str) -> None:
    image = build_image(variant)
    assert image.bases[-1] == f"base-{variant}", "the final stage must build FROM base-${VARIANT}"
    base = image.bases[0]
    if variant == "cpu":
        assert base.startswith("python:3.11-slim"), base
        assert image.env["TORCH_INDEX_URL"].endswith("/whl/cpu")
    else:
        assert base.startswith("nvidia/cuda:12.") and "cudnn-runtime" in base, base
        assert "/whl/cu12" in image.env["TORCH_INDEX_URL"]
        # ray.util.collective's NCCL backend needs CuPy.
        assert "cupy-cuda12x" in image.env["VARIANT_PACKAGES"]
        assert any("${VARIANT_PACKAGES}" in run and "pip install" in run for run in image.runs)
    assert image.env["IMAGE_VARIANT"] == variant


def test_default_variant_is_cpu() -> None:
    global_part, _ = read_dockerfile()
    assert "VARIANT=cpu" in [i.args for i in global_part if i.keyword == "ARG"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_pins_match_the_tested_environment(variant: str) -> None:
    image = build_image(variant)
    assert image.args["TORCH_VERSION"] == public_version("torch")
    assert image.args["TORCHVISION_VERSION"] == public_version("torchvision")
    assert image.args["RAY_VERSION"] == public_version("ray")
    installs = " ".join(image.runs)
    for pin in ('"torch==${TORCH_VERSION}"', '"torchvision==${TORCHVISION_VERSION}"', '"ray[default]==${RAY_VERSION}"'):
        assert pin in installs, f"the image does not install {pin}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_runs_as_a_numeric_non_root_user(variant: str) -> None:
    user = build_image(variant).user
    assert user is not None, "no USER: the image would run as root"
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: runAsNonRoot needs a numeric, non-zero uid"


@pytest.mark.parametrize("variant", VARIANTS)
def test_entrypoint_is_the_installed_script_under_an_init(variant: str) -> None:
    image = build_image(variant)
    installed = [c[-1] for c in image.copies if "deploy/entrypoint.sh" in c[:-1]]
    assert len(installed) == 1, "the Dockerfile must COPY deploy/entrypoint.sh once"
    copy = next(c for c in image.copies if "deploy/entrypoint.sh" in c[:-1])
    assert any(w.startswith("--chmod=") and int(w.split("=")[1], 8) & 0o111 for w in copy), "not executable"
    assert image.entrypoint[-1] == installed[0]
    # tini reaps the Ray daemons that `ray start` leaves behind in the API container.
    assert image.entrypoint[0].endswith("/tini") and any(" tini " in f" {run} " for run in image.runs)
    assert image.cmd == ["api"]
    assert image.healthcheck == [installed[0], "healthcheck"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_exposes_the_api_and_head_ports(variant: str) -> None:
    image = build_image(variant)
    assert int(image.env["API_PORT"]) in image.expose
    assert {6379, 8265} <= image.expose


def test_entrypoint_script_is_executable_bash() -> None:
    assert ENTRYPOINT.read_text().startswith("#!/usr/bin/env bash\n")
    assert os.access(ENTRYPOINT, os.X_OK), f"{ENTRYPOINT} is not executable (chmod 0755)"
    checked = subprocess.run(["bash", "-n", str(ENTRYPOINT)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_build_context_holds_exactly_what_the_image_copies() -> None:
    patterns = dockerignore_patterns()
    for variant in VARIANTS:
        for copy in build_image(variant).copies:
            if any(w.startswith("--from=") for w in copy):
                continue
            for source in (w for w in copy[:-1] if not w.startswith("--")):
                assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
                assert not dockerignored(source, patterns), f"{DOCKERIGNORE.name} leaves out {source}"
    for private in (".venv/bin/python", ".git/HEAD", "demo/report.json", ".bnrecal/ledger.db", "api/__pycache__/x.pyc"):
        assert dockerignored(private, patterns), f"{private} would be sent to the build"


# --- The entry script at work (dry runs, and the API lifecycle with stand-in programs) --


def test_api_mode_joins_the_cluster_as_a_zero_resource_node() -> None:
    commands = dry_run(["api"], {"RAY_ADDRESS": "head-svc:6379", "POD_IP": "10.1.2.3", **TOKEN})
    programs = [c[:2] for c in commands]
    assert programs == [["ray", "health-check"], ["ray", "start"], ["bnrecal", "serve"], ["ray", "stop"]]
    start = commands[1]
    assert {"--address=head-svc:6379", "--num-cpus=0", "--num-gpus=0", "--node-ip-address=10.1.2.3"} <= set(start)
    serve = commands[2]
    assert serve[serve.index("--ray-address") + 1] == "auto"
    assert serve[serve.index("--host") + 1] == "0.0.0.0"


def test_api_mode_without_a_cluster_serves_an_embedded_instance() -> None:
    commands = dry_run(["api", "--log-level", "debug"], {"API_PORT": "9000"})
    assert commands == [["bnrecal", "serve", "--host", "0.0.0.0", "--port", "9000", "--log-level", "debug"]]


def test_api_mode_refuses_ray_client_addresses() -> None:
    done = subprocess.run(
        ["bash", str(ENTRYPOINT), "api"], env={"PATH": os.environ["PATH"], "RAY_ADDRESS": "ray://head:10001"},
        capture_output=True, text=True, timeout=10,
    )
    assert done.returncode == 2
    assert "Ray Client" in done.stderr and "RAY_ADDRESS" in done.stderr


def test_other_modes() -> None:
    assert dry_run(["bnrecal", "calibrate", "--arch", "a b"], {}) == [["bnrecal", "calibrate", "--arch", "a b"]]
    worker = dry_run(["worker", "--num-cpus=4"], {"RAY_ADDRESS": "h:6379", **TOKEN})
    assert worker == [["ray", "health-check", "--address", "h:6379"],
                      ["ray", "start", "--address=h:6379", "--block", "--num-cpus=4"]]
    head = dry_run(["head"], TOKEN)[0]
    assert head[:3] == ["ray", "start", "--head"] and "--num-cpus=0" in head


@pytest.mark.parametrize("mode", ["head", "worker", "api"])
def test_ray_modes_refuse_to_run_without_the_cluster_token(mode: str) -> None:
    """A Ray node or driver of a cluster never runs open: without a token it stops at once
    (exit 2, one line), even where RAY_AUTH_MODE says disabled."""
    env = {"PATH": os.environ["PATH"], "RAY_ADDRESS": "h:6379", "RAY_AUTH_MODE": "disabled", "ENTRYPOINT_DRY_RUN": "1"}
    done = subprocess.run(["bash", str(ENTRYPOINT), mode], env=env, capture_output=True, text=True, timeout=10)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and "RAY_AUTH_TOKEN" in done.stderr, done.stderr


def test_ray_modes_run_ray_in_token_mode(tmp_path: Path) -> None:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    write_program(bin_dir, "ray", f'echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ray $*" >> {log}\n')
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled", **TOKEN}
    for mode in ("head", "worker"):
        done = subprocess.run(["bash", str(ENTRYPOINT), mode], env={**env, "RAY_ADDRESS": "h:6379"},
                              capture_output=True, text=True, timeout=10)
        assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all(c.startswith("RAY_AUTH_MODE=token ray ") for c in calls), calls


def write_program(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def stand_ins(tmp_path: Path) -> tuple[Path, Path]:
    """`ray` and `bnrecal` stand-ins that log their calls; `bnrecal serve` runs until
    SIGTERM (then exits 0), or exits at once with $SERVE_EXIT when that is set."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    write_program(bin_dir, "ray", f'echo "ray $*" >> {log}\n')
    write_program(bin_dir, "bnrecal", f"""echo "bnrecal $*" >> {log}
[[ -n "${{SERVE_EXIT:-}}" ]] && exit "$SERVE_EXIT"
trap 'echo "bnrecal got TERM" >> {log}; exit 0' TERM
while true; do sleep 0.05; done
""")
    return bin_dir, log


def start_api(bin_dir: Path, tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    return subprocess.Popen(
        ["bash", str(ENTRYPOINT), "api"], text=True, stderr=subprocess.PIPE,
        env={"PATH": path, "RAY_ADDRESS": "head-svc:6379", "TMPDIR": str(tmp_path), **TOKEN, **env},
    )


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_api_mode_forwards_sigterm_then_leaves_the_cluster(stand_ins: tuple[Path, Path], tmp_path: Path) -> None:
    bin_dir, log = stand_ins
    process = start_api(bin_dir, tmp_path)
    wait_for(lambda: log.exists() and "bnrecal serve" in log.read_text())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    calls = log.read_text().splitlines()
    assert [c.split()[:2] for c in calls] == [
        ["ray", "health-check"], ["ray", "start"], ["bnrecal", "serve"], ["bnrecal", "got"], ["ray", "stop"],
    ], calls


def test_api_mode_passes_on_the_server_exit_status(stand_ins: tuple[Path, Path], tmp_path: Path) -> None:
    bin_dir, log = stand_ins
    process = start_api(bin_dir, tmp_path, SERVE_EXIT="3")
    assert process.wait(timeout=10) == 3
    assert log.read_text().splitlines()[-1].startswith("ray stop")


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.skipif(subprocess.run(["which", "wget"], capture_output=True).returncode != 0, reason="no wget here")
def test_healthcheck_asks_the_api_for_healthz(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "bnrecal-entrypoint.mode").write_text("api\n")
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "API_PORT": str(server.server_address[1])}
    try:
        check = ["bash", str(ENTRYPOINT), "healthcheck"]
        assert subprocess.run(check, env=env, capture_output=True, timeout=10).returncode == 0
        _Health.status = 500
        assert subprocess.run(check, env=env, capture_output=True, timeout=10).returncode != 0
    finally:
        _Health.status = 200
        server.shutdown()
