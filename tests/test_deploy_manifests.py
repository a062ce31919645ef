"""The Kubernetes manifests in deploy/kubernetes: every object is valid for Kubernetes 1.33 (the
core kinds against the schemas `kubernetes-validate` ships, offline; LeaderWorkerSet against
tests/schemas/leaderworkerset-v1.json, its pod templates against Kubernetes' PodTemplateSpec), every
`tokenspeed serve` command in them parses, the probes, metrics annotations and grace periods agree
with those commands, and the single-node command, run here on CPU, answers the probes and
/metrics and drains on SIGTERM within the pod's grace period."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from server_harness import start_server, stop_server, wait_exit
from tokenspeed.config import parse_serve_args

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
LWS_SCHEMA = Path(__file__).resolve().parent / "schemas" / "leaderworkerset-v1.json"
K8S_VERSION = "1.33"
# What LWS injects into every container of a group (the values here are examples).
LWS_ENV = {"LWS_LEADER_ADDRESS": "tokenspeed-multinode-0.tokenspeed-multinode", "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": "1"}
# After the drain (--shutdown-timeout) the workers and shm rings still have to go.
TEARDOWN_S = 25


def _objects() -> list[dict[str, Any]]:
    objs = [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]
    assert {o["kind"] for o in objs} >= {"Deployment", "Service", "LeaderWorkerSet"}
    return objs


def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [t for t in (lwt.get("leaderTemplate"), lwt["workerTemplate"]) if t]
    return []


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion in command and args."""
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    assert "$(" not in arg, f"unexpanded variable in {arg!r}"
    return arg


def _serve_args(container: dict[str, Any]) -> list[str]:
    assert container["command"] == ["tokenspeed", "serve"]
    return [_expand(a, LWS_ENV) for a in container["args"]]


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def _tokenspeed_containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in _objects():
        for template in _pod_specs(obj):
            for c in template["spec"]["containers"]:
                yield template, c


def test_core_objects_are_valid_kubernetes() -> None:
    for obj in _objects():
        if obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_leaderworkerset_matches_its_crd_and_pod_templates_are_valid() -> None:
    schema = json.loads(LWS_SCHEMA.read_text())
    sets = [o for o in _objects() if o["kind"] == "LeaderWorkerSet"]
    assert sets
    for lws in sets:
        jsonschema.validate(lws, schema)
        for template in _pod_specs(lws):
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                       "template": template}
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def test_the_validators_catch_mistakes() -> None:
    """A typo in a pod spec or in an LWS field must fail, or the checks above prove nothing."""
    deployment = next(o for o in _objects() if o["kind"] == "Deployment")
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    lws = next(o for o in _objects() if o["kind"] == "LeaderWorkerSet")
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.loads(LWS_SCHEMA.read_text()))


def test_every_serve_command_parses() -> None:
    seen = 0
    for _, container in _tokenspeed_containers():
        parse_serve_args(_serve_args(container))  # raises on an unknown or refused flag
        seen += 1
    assert seen == 3  # single-node, LWS leader, LWS worker


def test_probes_metrics_and_grace_period_agree_with_the_command() -> None:
    for template, container in _tokenspeed_containers():
        args = _serve_args(container)
        cfg = parse_serve_args(args)
        spec = template["spec"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert spec["terminationGracePeriodSeconds"] >= pre_stop + cfg.shutdown_timeout + TEARDOWN_S
        if cfg.node_rank:  # LWS workers: no HTTP server
            assert "livenessProbe" not in container and "ports" not in container
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == cfg.port and cfg.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > cfg.shutdown_timeout
        notes = template["metadata"]["annotations"]
        assert cfg.enable_metrics and notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == cfg.port and notes["prometheus.io/path"] == "/metrics"


def test_services_select_the_serving_pods() -> None:
    objs = _objects()
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        targets = [t for o in objs for t in _pod_specs(o)
                   if o["kind"] == "Deployment" and sel.items() <= t["metadata"]["labels"].items()
                   or o["kind"] == "LeaderWorkerSet"
                   and sel.get("leaderworkerset.sigs.k8s.io/name") == o["metadata"]["name"]
                   and sel.items() - {("leaderworkerset.sigs.k8s.io/name", o["metadata"]["name"])}
                   <= t.get("metadata", {}).get("labels", {}).items()]
        assert len(targets) == 1, svc["metadata"]["name"]
        names = {p["name"] for c in targets[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def _local_args(container: dict[str, Any]) -> list[str]:
    """The manifest's command for this machine: the default model (the harness adds --host,
    --port and --device cpu)."""
    args = _serve_args(container)
    for name in ("--model-path", "--host", "--port"):
        i = args.index(name)
        del args[i:i + 2]
    return args


def test_single_node_command_serves_probes_and_drains_within_the_grace_period(tmp_path: Path) -> None:
    deployment = next(o for o in _objects() if o["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    srv = start_server(str(tmp_path), *_local_args(container))
    try:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        metrics = httpx.get(f"{srv.url}{template['metadata']['annotations']['prometheus.io/path']}",
                            timeout=10)
        assert metrics.status_code == 200 and "tokenspeed:" in metrics.text
        out: dict = {}

        def long_request() -> None:
            r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 0})
            out["status"], out["body"] = r.status_code, r.json()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        sent = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGTERM)  # what the kubelet sends after preStop
        time.sleep(0.3)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503  # readiness drops
        t.join(120)
        assert out.get("status") == 200, out
        assert out["body"]["usage"]["completion_tokens"] == 24
        code = wait_exit(srv, template["spec"]["terminationGracePeriodSeconds"])
        assert code == 0, srv.log()[-3000:]
        assert time.monotonic() - sent < template["spec"]["terminationGracePeriodSeconds"]
    finally:
        stop_server(srv)
