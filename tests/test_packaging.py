"""The wheel installs one top-level name, ``bnrecal`` (docs/architecture.md, "One installed
name"): the repository's ``service/``, ``workers/`` and ``api/`` land beneath it, so a
training repository with its own ``service``, ``api`` or ``workers`` package can import
bnrecal, and its own packages stay its own.

The wheel is built from a copy of the sources and installed into a fresh virtual
environment (the third-party packages come from the test environment's site-packages,
read as a plain path: the editable install's finder is not active there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "bnrecal", "service", "workers", "api")

USER_SCRIPT = """
import sys
import service, api, workers            # the user's own packages, beside this script
import torch
from torch import nn

import bnrecal

model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
model(torch.zeros(1, 3, 8, 8))
report = bnrecal.recalibrate(model, torch.randn(64, 3, 8, 8), batch_size=16, progress=False)
assert report["samples"] == 64, report["samples"]
import service as again
assert again is service and service.WHO == api.WHO == workers.WHO == "user", "the user's packages were replaced"
assert bnrecal.__file__.startswith(sys.prefix), bnrecal.__file__
assert all(not name.startswith(("service.", "workers.", "api.")) for name in sys.modules), "bnrecal imported bare names"
print("OK", bnrecal.recalibrate.__module__)
"""


def package_folders() -> set[str]:
    """Every folder of the repository that holds files to install (a package, or the web
    page's data), by its installed name."""
    names = {"bnrecal"}
    for top in ("service", "workers", "api"):
        for folder in [ROOT / top, *(ROOT / top).rglob("*")]:
            if folder.is_dir() and folder.name != "__pycache__" and any(p.is_file() for p in folder.iterdir()):
                names.add("bnrecal." + ".".join(folder.relative_to(ROOT).parts))
    return names


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from this checkout; returns its python."""
    base = tmp_path_factory.mktemp("packaging")
    source = base / "src"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    wheels = base / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--verbose", "-w", str(wheels),
         str(source)], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (base / "build.log").write_text(build.stdout + build.stderr)
    (wheel,) = wheels.glob("bnrecal-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
         str(wheel)], capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # torch, ray and the rest from where the test environment has them, as plain paths (their .pth
    # files stay unread, so no editable finder of this checkout comes along)
    import numpy
    import torch

    places = {str(Path(module.__file__).resolve().parents[1]) for module in (torch, numpy)}
    Path(site, "test-dependencies.pth").write_text("\n".join(sorted(places)) + "\n")
    return python


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_the_wheel_holds_one_top_level_name_and_every_package():
    """The wheel's files sit under ``bnrecal/`` (and its dist-info) only, and every package
    folder of the repository is in it: a folder left out of pyproject's list fails here."""
    listed = subprocess.run(
        [sys.executable, "-c", "import tomllib, sys; print('\\n'.join(tomllib.load(open(sys.argv[1], 'rb'))"
         "['tool']['setuptools']['packages']))", str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert set(listed) == package_folders()


def test_the_build_warns_of_nothing(installed):
    """setuptools says nothing of the package list (it warned, 40 lines each, of the web
    page's folders being importable yet unlisted, on every ``pip install -e .``)."""
    log = (Path(installed).parents[2] / "build.log").read_text()
    warnings = [line for line in log.splitlines() if "Warning:" in line or "absent from" in line]
    assert not warnings, "\n".join(warnings)


def test_a_users_own_service_api_and_workers_packages_neither_shadow_nor_are_shadowed(installed, tmp_path):
    project = tmp_path / "training-repo"
    for name in ("service", "api", "workers"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text('WHO = "user"\n')
    (project / "train.py").write_text(USER_SCRIPT)
    done = subprocess.run([str(installed), "train.py"], cwd=project, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["OK", "bnrecal.service.live.run"]

    site = Path(installed).parents[1]
    top = {p.name for p in (site / "lib").glob("python*/site-packages/*") if not p.name.endswith((".pth", "-info"))}
    assert top - {"__pycache__"} == {"bnrecal"}, top

    cli = subprocess.run([str(Path(installed).parent / "bnrecal"), "--help"], cwd=project, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "calibrate" in cli.stdout and "serve" in cli.stdout


def test_the_installed_wheel_carries_the_web_pages(installed):
    """Package data travels with the renamed package: the page's templates and scripts."""
    (wheel_site,) = Path(installed).parents[1].glob("lib/python*/site-packages")
    assert (wheel_site / "bnrecal" / "api" / "templates" / "jobs.html").is_file()
    assert (wheel_site / "bnrecal" / "api" / "static" / "api.js").is_file()
