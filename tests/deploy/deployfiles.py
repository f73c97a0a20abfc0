"""Readers for the files under deploy/: the Dockerfile, the entry script and the manifests.

No Docker engine or Kubernetes is needed: the Dockerfile is read line by line (as BuildKit
reads it, for the instructions used there), the manifests with ``yaml.safe_load_all``,
and the entry script runs in its dry-run mode, which prints the commands it would run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
GUIDE = DEPLOY / "README.md"
BASE = DEPLOY / "kuberay"  # the single-replica SQLite variant
REPLICATED = DEPLOY / "kuberay-replicated"  # its overlay: N replicas on Postgres and object storage
VARIANTS = ("cpu", "cuda")
# KubeRay names the head's Service after the RayCluster: <metadata.name>-head-svc.
HEAD_SERVICE_SUFFIX = "-head-svc"
DEFAULT_GCS_PORT = 6379

Doc = dict[str, Any]


# --- Dockerfile ---------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def read_dockerfile(path: Path = DOCKERFILE) -> tuple[list[Instruction], list[Stage]]:
    """The global instructions (before the first FROM) and the stages, continuations joined."""
    global_part: list[Instruction] = []
    stages: list[Stage] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text, pending = pending + stripped, ""
        keyword, _, args = text.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), start)
        if instruction.keyword == "FROM":
            parts = instruction.args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            global_part.append(instruction)
    return global_part, stages


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ARG":
            name, _, value = instruction.args.partition("=")
            defaults[name] = value
    return defaults


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand ``$NAME`` and ``${NAME}`` as Docker does; unknown names are left as they are."""
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


@dataclass
class Image:
    """What an image variant is, as far as the runtime cares: the final stage's config."""

    variant: str
    bases: list[str]  # the base images of the stages it is built from, outermost first
    env: dict[str, str]
    args: dict[str, str]
    user: str | None
    expose: set[int]
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]
    copies: list[list[str]]  # each COPY's words (flags, sources, destination)
    runs: list[str]  # as written


def build_image(variant: str, path: Path = DOCKERFILE) -> Image:
    """Follow the final stage's FROM chain for one ``VARIANT`` and collect its config."""
    global_part, stages = read_dockerfile(path)
    global_args = _arg_defaults(global_part) | {"VARIANT": variant}
    by_name = {stage.name: stage for stage in stages if stage.name}
    chain: list[Stage] = []
    stage: Stage | None = stages[-1]
    while stage is not None:
        chain.insert(0, stage)
        stage = by_name.get(expand(stage.base, global_args))
    image = Image(variant, [], {}, {}, None, set(), [], [], [], [], [])
    for stage in chain:
        image.bases.append(expand(stage.base, global_args))
        scope = dict(image.env)
        for instruction in stage.instructions:
            words = instruction.args
            if instruction.keyword == "ARG":
                name, has_default, default = words.partition("=")
                value = expand(default, scope) if has_default else global_args.get(name, "")
                scope[name] = image.args[name] = value
            elif instruction.keyword == "ENV":
                for token in shlex.split(words):
                    name, _, value = token.partition("=")
                    scope[name] = image.env[name] = expand(value, scope)
            elif instruction.keyword == "USER":
                image.user = expand(words, scope)
            elif instruction.keyword == "EXPOSE":
                image.expose |= {int(port.split("/")[0]) for port in expand(words, scope).split()}
            elif instruction.keyword in ("ENTRYPOINT", "CMD"):
                setattr(image, instruction.keyword.lower(), json.loads(words))
            elif instruction.keyword == "HEALTHCHECK":
                image.healthcheck = json.loads(words[words.index("CMD") + 3 :])
            elif instruction.keyword == "COPY":
                image.copies.append(shlex.split(expand(words, scope)))
            elif instruction.keyword == "RUN":
                image.runs.append(words)  # the shell expands these at build time, not Docker
    return image


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore glob as a regular expression (``**`` spans folders, ``*`` does not)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out: the last pattern that matches the path
    or one of its parent folders decides; ``!`` lets it back in."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _ignore_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def dockerignore_patterns(path: Path = DOCKERIGNORE) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


# --- Manifests ----------------------------------------------------------------------


def manifest_files() -> list[Path]:
    """The base variant's manifests (``kubectl apply -k deploy/kuberay``)."""
    return sorted(p for p in BASE.rglob("*") if p.suffix in (".yaml", ".yml"))


def overlay_kustomization() -> Doc:
    """The replicated overlay's kustomization."""
    return _load(REPLICATED / "kustomization.yaml")[0]


def _json_patch(document: Doc, operation: Doc) -> None:
    """Apply one JSON 6902 ``add`` or ``replace`` (the ops the overlay uses) to ``document``."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    assert op in ("add", "replace"), f"the overlay uses a {op!r} op this reader does not apply"
    if isinstance(node, list):
        if last == "-":
            assert op == "add"
            node.append(operation["value"])
        elif op == "add":
            node.insert(int(last), operation["value"])
        else:
            node[int(last)] = operation["value"]
    else:
        assert op == "add" or last in node, f"replace of a missing {operation['path']}"
        node[last] = operation["value"]


def replicated_manifests() -> list[Doc]:
    """The base manifests with the overlay's patches applied as kustomize applies them: JSON 6902
    operations on their target, and a strategic-merge ``$patch: delete`` of a whole object."""
    kustomization = overlay_kustomization()
    assert kustomization["resources"] == ["../kuberay"], kustomization["resources"]
    docs = manifests()
    for entry in kustomization["patches"]:
        patch = yaml.safe_load(entry["patch"])
        if isinstance(patch, dict):
            assert patch.get("$patch") == "delete", "only whole-object deletion is read from strategic patches"
            name = patch["metadata"]["name"]
            docs = [d for d in docs if (d["kind"], d.get("metadata", {}).get("name")) != (patch["kind"], name)]
            continue
        target = one(docs, entry["target"]["kind"], entry["target"]["name"])
        for operation in patch:
            _json_patch(target, operation)
    return docs


@cache
def _load(path: Path) -> tuple[Doc, ...]:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


def manifests() -> list[Doc]:
    """Every YAML document under deploy/ (fresh copies: tests may change them)."""
    import copy

    return [copy.deepcopy(doc) for path in manifest_files() for doc in _load(path)]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc.get("kind") == kind]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in of_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def api_deployment(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment", "bnrecal-api")


def api_container(docs: list[Doc]) -> Doc:
    containers = api_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "api")


def ray_pods(cluster: Doc) -> Iterator[tuple[str, Doc, Doc]]:
    """(role, rayStartParams, pod spec) of the head and of each worker group."""
    head = cluster["spec"]["headGroupSpec"]
    yield "head", head.get("rayStartParams", {}), head["template"]["spec"]
    for group in cluster["spec"].get("workerGroupSpecs", []):
        yield group["groupName"], group.get("rayStartParams", {}), group["template"]["spec"]


def pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    """Every pod template: the API's and each Ray group's."""
    yield "api", api_deployment(docs)["spec"]["template"]["spec"]
    for cluster in of_kind(docs, "RayCluster"):
        for role, _, spec in ray_pods(cluster):
            yield f"{cluster['metadata']['name']}/{role}", spec


def container_env(container: Doc, docs: list[Doc], secret_value: str = "secret") -> dict[str, str]:
    """The environment a container starts with: ConfigMaps it loads, then its own ``env``.
    Values from Secrets read as ``secret_value``; from the downward API, a pod IP."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            data = one(docs, "ConfigMap", source["configMapRef"]["name"]).get("data", {})
            env.update({k: str(v) for k, v in data.items()})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            env[item["name"]] = secret_value
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = "10.0.0.7"
    return env


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- The entry script and the programs it runs ----------------------------------------


def dry_run(args: list[str], env: Mapping[str, str]) -> list[list[str]]:
    """The commands ``entrypoint.sh args`` would run with ``env``, each split into words."""
    full_env = {**env, "PATH": os.environ["PATH"], "ENTRYPOINT_DRY_RUN": "1"}  # this machine's PATH
    done = subprocess.run(
        ["bash", str(ENTRYPOINT), *args], env=full_env, capture_output=True, text=True, timeout=10
    )
    assert done.returncode == 0, f"entrypoint {args} failed: {done.stderr.strip()}"
    return [shlex.split(line) for line in done.stdout.splitlines() if line.strip()]


def option_names(words: list[str]) -> list[str]:
    """The ``--option`` names used in a command line (``--a=b`` gives ``--a``)."""
    return [word.split("=", 1)[0] for word in words if word.startswith("--")]


def ray_cli_options(command: str) -> dict[str, bool]:
    """``--option`` -> is_flag for a ``ray`` subcommand, read from the installed Ray's
    source (importing ray.scripts takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "ray is not installed"
    source = (Path(spec.origin).parent / "scripts" / "scripts.py").read_text()
    named = re.search(rf'^@cli\.command\(name="{command}"', source, flags=re.M)
    start = named.start() if named else None
    if start is None:
        definition = re.search(rf"^def {command.replace('-', '_')}\(", source, flags=re.M)
        assert definition, f"no `ray {command}` in the installed Ray"
        head = source[: definition.start()]
        start = max(head.rfind("\n@cli.command"), head.rfind("\n@click.command"))
    end = re.compile(r"^def ", flags=re.M).search(source, start)
    assert end is not None
    decorators = source[start : end.start()]
    options: dict[str, bool] = {}
    for block in decorators.split("@click.option(")[1:]:
        flag = "is_flag=True" in block
        for name in re.findall(r'"(--[\w-]+)"', block.split(")\n@")[0]):
            options[name] = flag
    return options
