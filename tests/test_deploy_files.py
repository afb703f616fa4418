"""The deployment files (docker/, docker/k8s/) hold configs that the server and the agent accept, and the agent's
endpoint list for the fleet matches the StatefulSet (rank r -> server r mod n). docker/test.sh runs the image."""
from __future__ import annotations

import json
import os
import re

from tests.support import ROOT

DOCKER = os.path.join(ROOT, "docker")


def _embedded_json(path: str, key: str) -> dict:
    text = open(path, encoding="utf-8").read()
    block = re.search(rf"^\s*{re.escape(key)}: \|\n((?:\s{{4,}}.*\n?)+)", text, re.M)
    assert block, f"{path}: no {key} block"
    return json.loads(block.group(1))


def test_server_configs_are_valid():
    from gpu_server.config import parse_server_config

    fleet = _embedded_json(os.path.join(DOCKER, "k8s", "gpu-server.yaml"), "server.json")
    assert fleet["run_ut"]["tls_path"] == "/certs/server"
    for raw in [json.load(open(os.path.join(DOCKER, "config", name))) for name in ("server.json", "server-tls.json")]\
            + [fleet]:
        raw["run_ut"]["tls_path"] = ""          # the certificate folders exist only inside the containers
        config = parse_server_config(raw)
        assert config.host == "0.0.0.0" and config.port == 50051


def test_agent_configs_are_valid_and_the_fleet_list_matches_the_statefulset():
    from npu_agent.config import parse_config

    for name in ("agent.json", "agent-tls.json"):
        raw = json.load(open(os.path.join(DOCKER, "config", name)))
        raw["tensor"]["tls_path"] = ""          # the certificate folders exist only inside the containers
        assert parse_config(raw)
    raw = _embedded_json(os.path.join(DOCKER, "k8s", "agent-config.yaml"), "config.json")
    hosts = raw["tensor"]["host"]
    replicas = int(re.search(r"^\s*replicas: (\d+)", open(os.path.join(DOCKER, "k8s", "gpu-server.yaml")).read(),
                             re.M).group(1))
    assert hosts == [f"gpu-server-{i}.gpu-server.default.svc.cluster.local:50051" for i in range(replicas)]
    raw["tensor"]["tls_path"] = ""
    config = parse_config(raw)
    endpoints = getattr(config, "endpoints", None)
    assert endpoints is None or len(endpoints) == replicas


def test_compose_entrypoints_import_what_the_image_holds():
    """Every `from M import f` a compose service runs names a module of this repository that the image copies
    (docker/Dockerfile.server COPYs its file or folder)."""
    with open(os.path.join(ROOT, "docker", "compose.yaml"), encoding="utf-8") as fh:
        compose = fh.read()
    with open(os.path.join(ROOT, "docker", "Dockerfile.server"), encoding="utf-8") as fh:
        dockerfile = fh.read()
    modules = re.findall(r"from ([A-Za-z_][\w.]*) import", compose)
    assert modules, "compose.yaml runs no Python entrypoint any more: is this test still reading the right file?"
    for module in modules:
        rel = module.replace(".", "/") + ".py"
        assert os.path.isfile(os.path.join(ROOT, rel)), f"compose.yaml imports {module}, but {rel} does not exist"
        top = module.split(".")[0]
        assert re.search(rf"^COPY .*\b{re.escape(rel)}\b|^COPY {re.escape(top)}/ ", dockerfile, re.M), \
            f"compose.yaml imports {module}, which docker/Dockerfile.server does not copy into the image"
