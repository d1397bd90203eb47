"""deploy/: the Envoy and Kubernetes files parse, say what the HAProxy one says (which
tests/test_deploy_haproxy.py runs for real), and the Kubernetes preStop hook really waits for a
replica's calls to end."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import trio
import trio_websocket
import yaml

from test_server import _start, http_get

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _haproxy() -> dict[str, str]:
    """The settings the other files must match, read from deploy/haproxy/haproxy.cfg."""
    text = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    found = {
        "balance": re.search(r"^\s*balance (\S+)", text, re.M).group(1),
        "check_uri": re.search(r"^\s*http-check send meth GET uri (\S+)", text, re.M).group(1),
        "inter": re.search(r"default-server check inter (\d+)ms", text).group(1),
        "fall": re.search(r" fall (\d+)", text).group(1),
        "rise": re.search(r" rise (\d+)", text).group(1),
        "tunnel": re.search(r"timeout tunnel (\d+)h", text).group(1),
        "servers": re.findall(r'^\s*server \S+ "\$\{DUPLEXRT_REPLICA_\d-([\d.:]+)\}"', text, re.M),
        "names": re.findall(r'^\s*server (\S+) "', text, re.M),
    }
    # A resume goes to the replica its token names, whatever its health (force-persist).
    assert "use-server %[urlp(resume),field(1,.)] if { urlp(resume) -m found }" in text
    assert "force-persist if { urlp(resume) -m found }" in text
    assert "option httpchk" in text and "http-check expect status 200" in text
    return found


def _envoy() -> dict:
    return yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())


def test_haproxy_balances_by_least_connections_on_readyz():
    haproxy = _haproxy()
    assert haproxy["balance"] == "leastconn" and haproxy["check_uri"] == "/readyz"
    assert (haproxy["fall"], haproxy["rise"]) == ("1", "1") and int(haproxy["inter"]) <= 1000
    assert haproxy["servers"] == ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


def test_envoy_says_what_haproxy_says():
    haproxy = _haproxy()
    resources = _envoy()["static_resources"]
    cluster, *singles = resources["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    (check,) = cluster["health_checks"]
    assert check["http_health_check"]["path"] == haproxy["check_uri"]
    assert float(check["interval"].rstrip("s")) * 1000 == int(haproxy["inter"])
    assert (str(check["unhealthy_threshold"]), str(check["healthy_threshold"])) == (haproxy["fall"], haproxy["rise"])
    endpoints = [e["endpoint"]["address"]["socket_address"] for e in
                 cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert [f"{a['address']}:{a['port_value']}" for a in endpoints] == haproxy["servers"]
    (listener,) = resources["listeners"]
    (manager,) = listener["filter_chains"][0]["filters"]
    config = manager["typed_config"]
    assert {"upgrade_type": "websocket"} in config["upgrade_configs"]
    tunnel_s = int(haproxy["tunnel"]) * 3600
    assert int(config["stream_idle_timeout"].rstrip("s")) == tunnel_s
    *resumes, route = config["route_config"]["virtual_hosts"][0]["routes"]
    # A resume goes to the replica its token names: one route and one unchecked cluster per
    # replica, named as HAProxy names its servers (the replicas' --replica-id).
    assert [r["match"]["query_parameters"][0] for r in resumes] == [
        {"name": "resume", "string_match": {"prefix": f"{name}."}} for name in haproxy["names"]]
    assert [r["route"]["cluster"] for r in resumes] == [c["name"] for c in singles] == haproxy["names"]
    assert all("health_checks" not in c for c in singles)
    assert [f"{a['address']}:{a['port_value']}" for a in (
        c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
        for c in singles)] == haproxy["servers"]
    assert route["route"]["cluster"] == cluster["name"] and route["route"]["timeout"] == "0s"
    assert int(route["route"]["idle_timeout"].rstrip("s")) == tunnel_s
    assert 503 in route["route"]["retry_policy"]["retriable_status_codes"]


def _kubernetes() -> dict[str, dict]:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "duplexrt.yaml").read_text()))
    return {d["kind"]: d for d in documents}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_kubernetes_runs_one_process_per_gpu_probed_drained_and_scraped():
    objects = _kubernetes()
    deployment, budget, service = objects["Deployment"], objects["PodDisruptionBudget"], objects["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = int(_env(container)["DUPLEXRT_PORT"])
    assert container["ports"][0]["containerPort"] == port
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert _env(container)["DUPLEXRT_REPLICA_ID"] is None  # from the Pod's name
    # The grace period covers the longest call (the preStop wait) and then SIGTERM's drain.
    grace = float(container["args"][container["args"].index("--set") + 1].split("=")[1])
    call_max = float(_env(container)["CALL_MAX_S"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > call_max + grace + 3
    labels = pod["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], budget["spec"]["selector"]["matchLabels"],
                     service["spec"]["selector"]):
        assert selector.items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


async def test_the_kubernetes_prestop_hook_waits_for_the_calls_to_end(nursery):
    (container,) = _kubernetes()["Deployment"]["spec"]["template"]["spec"]["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "python3"
    running = await _start(nursery)
    env = {**os.environ, "DUPLEXRT_PORT": str(running.port), "CALL_MAX_S": "30"}
    ended_at: dict[str, float] = {}

    async def hook() -> None:
        await trio.run_process([sys.executable, *command[1:]], env=env)
        ended_at["hook"] = trio.current_time()

    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()  # session.created
        started = trio.current_time()
        async with trio.open_nursery() as hooks:
            hooks.start_soon(hook)
            await trio.sleep(1.5)  # a real process polling each second: no event to wait on
            assert "hook" not in ended_at  # one call under way: still waiting
            await ws.send_message(json.dumps({"type": "input.end"}))
            while isinstance(message := await ws.get_message(), bytes) or \
                    json.loads(message)["type"] != "session.end":
                pass
            ended_at["call"] = trio.current_time()
    assert ended_at["call"] <= ended_at["hook"] < started + 10
    assert json.loads((await http_get(running.port, "/readyz"))[2])["sessions"] == 0
