"""deploy/: the Envoy and Kubernetes files parse, say what the HAProxy one says (which
tests/test_deploy_haproxy.py runs for real), the Kubernetes manifest passes the API's own schemas
(kubernetes-validate, strict, offline), and its preStop hook really begins a replica's drain
while the call under way goes on."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import trio
import trio_websocket
import yaml

from conftest import http_get

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
    # POST /drain stops a replica: never forwarded from the public side (issue 38, item 1).
    assert "http-request deny deny_status 403 if { path,url_dec -m beg -i /drain }" in text
    assert "option forwardfor" in text
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
    *singles, cluster = resources["clusters"]
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
    drain, *resumes, route = config["route_config"]["virtual_hosts"][0]["routes"]
    # POST /drain stops a replica: answered by Envoy, never forwarded (issue 38, item 1).
    assert drain["match"] == {"prefix": "/drain", "case_sensitive": False}
    assert drain["direct_response"]["status"] == 403 and "route" not in drain
    assert config["normalize_path"] is True and config["use_remote_address"] is True
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
    # No retry of a refused upgrade: Envoy's retry of an upgrade was never seen to work here,
    # and a 503 with Retry-After reaches the client, which tries again.
    assert "retry_policy" not in route["route"]


def test_envoy_writes_each_replica_address_once_and_sets_no_ceiling_on_calls():
    text = (DEPLOY / "envoy" / "envoy.yaml").read_text()
    for address in _haproxy()["servers"]:
        port = address.split(":")[1]
        assert text.count(f"port_value: {port}") == 1, address
    for cluster in _envoy()["static_resources"]["clusters"]:
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        # Envoy's default of 1024 open requests per cluster would cap the calls at 1024.
        assert min(limits["max_connections"], limits["max_requests"], limits["max_pending_requests"]) >= 100_000


def test_envoy_logs_each_call_with_the_replica_that_took_it():
    (listener,) = _envoy()["static_resources"]["listeners"]
    (manager,) = listener["filter_chains"][0]["filters"]
    (access_log,) = manager["typed_config"]["access_log"]
    assert access_log["typed_config"]["@type"].endswith("StdoutAccessLog")
    line = access_log["typed_config"]["log_format"]["text_format_source"]["inline_string"]
    for field in ("%UPSTREAM_HOST%", "%RESPONSE_CODE%", "%DURATION%", "%REQ(:PATH)%"):
        assert field in line


def _kubernetes() -> dict[str, dict]:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "duplexrt.yaml").read_text()))
    return {d["kind"]: d for d in documents}


def _claims() -> dict[str, dict]:
    """The manifest's PersistentVolumeClaims, by name."""
    documents = yaml.safe_load_all((DEPLOY / "kubernetes" / "duplexrt.yaml").read_text())
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == "PersistentVolumeClaim"}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_kubernetes_runs_one_process_per_gpu_probed_drained_and_scraped():
    objects = _kubernetes()
    deployment, budget, service = objects["Deployment"], objects["PodDisruptionBudget"], objects["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Readiness that a full Pod keeps: rolling updates and node drains do not wait for calls.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz?full=ok"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = int(_env(container)["DUPLEXRT_PORT"])
    assert container["ports"][0]["containerPort"] == port
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert _env(container)["DUPLEXRT_REPLICA_ID"] is None  # from the Pod's name
    # Kubernetes' grace period covers the drain's: the calls' grace, then two close timeouts.
    setting = container["args"][container["args"].index("--set") + 1]
    assert setting.startswith("server.shutdown_grace_s=")
    grace = float(setting.split("=")[1])
    assert grace >= 600, "long enough for a call"
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace + 2 * 3
    # The weights cache: a volume where the image keeps them (its HF_HOME).
    hf_home = re.search(r"HF_HOME=(\S+)", (DEPLOY.parent / "Dockerfile").read_text()).group(1)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == hf_home]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] in _claims()
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]
    labels = pod["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], budget["spec"]["selector"]["matchLabels"],
                     service["spec"]["selector"]):
        assert selector.items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_the_kubernetes_manifest_passes_the_api_schemas_strictly():
    import kubernetes_validate

    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "duplexrt.yaml").read_text()))
    for document in documents:
        kubernetes_validate.validate(document, "1.30.0", strict=True)
    # The check can fail: a misspelled field in the Pod template is refused.
    broken = json.loads(json.dumps(documents[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    try:
        kubernetes_validate.validate(broken, "1.30.0", strict=True)
    except kubernetes_validate.ValidationError:
        pass
    else:
        raise AssertionError("a misspelled field passed")


async def test_the_kubernetes_prestop_hook_begins_the_drain_with_the_key_and_the_call_goes_on(start_server):
    (container,) = _kubernetes()["Deployment"]["spec"]["template"]["spec"]["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "python3"
    # Inside the Pod, on loopback: the one peer a replica drains for without the admin key.
    assert "http://127.0.0.1:%s/drain" in command[-1]
    key = "sk-k8s"
    running = await start_server(f'server.api_key="{key}"', "server.shutdown_grace_s=600")
    env = {**os.environ, "DUPLEXRT_PORT": str(running.port), "DUPLEXRT_API_KEY": key + "\n"}
    headers = [("authorization", f"Bearer {key}")]
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex"), extra_headers=headers) as ws:
        await ws.get_message()  # session.created
        # Without the key the hook fails: the drain is not for anyone who can reach the port.
        failed = await trio.run_process([sys.executable, *command[1:]], env={**env, "DUPLEXRT_API_KEY": ""},
                                        check=False, capture_stderr=True)
        assert failed.returncode != 0 and b"401" in failed.stderr and not running.server.draining
        hook = await trio.run_process([sys.executable, *command[1:]], env=env, capture_stdout=True)
        assert json.loads(hook.stdout)["draining"] is True and running.server.draining
        status, _, body = await http_get(running.port, "/readyz?full=ok")
        assert status == 503 and json.loads(body)["reason"] == "draining"
        audio = (b"\x00\x00\x80\x3e") * 1920  # one frame of 0.25
        await ws.send_message(audio)
        heard = await ws.get_message()
        assert heard == audio, "the call goes on through the drain"
        await ws.send_message(json.dumps({"type": "input.end"}))
        while isinstance(message := await ws.get_message(), bytes):
            pass
        assert json.loads(message)["reason"] == "stop"


# -- the image (no Docker here: what the Dockerfile and the README's run lines say) -------------------

DOCKERFILE = DEPLOY.parent / "Dockerfile"
README = DEPLOY.parent / "README.md"
OPERATOR = DEPLOY.parent / "docs" / "operator.md"  # the container image and the deploy notes


def _image_stage() -> str:
    """The Dockerfile's last stage (the image), comments left out, continuation lines joined."""
    text = DOCKERFILE.read_text()
    stage = text[text.rindex("\nFROM "):]
    lines = [line for line in stage.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ")


def _image_env() -> dict[str, str]:
    (block,) = re.findall(r"^ENV (.*)$", _image_stage(), re.M)
    return dict(pair.split("=", 1) for pair in block.split())


def test_the_image_has_a_c_compiler_for_torch_compile():
    """Triton compiles a C launcher at run time for the moshi package's torch.compiled kernels: a
    CUDA runtime base has no compiler, and no Python headers."""
    installs = " ".join(re.findall(r"apt-get install ([^&]*)", _image_stage()))
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"(^|\s){re.escape(package)}(\s|$)", installs), package


def test_the_images_user_owns_its_cache_folders_so_fresh_volumes_are_writable():
    stage = _image_stage()
    env = _image_env()
    folders = [env["HF_HOME"], env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]]
    (run,) = [r for r in re.findall(r"^RUN (.*)$", stage, re.M) if "useradd" in r]
    made = re.search(r"mkdir -p ([^&]*)", run).group(1).split()
    owned = re.search(r"chown -R duplexrt:duplexrt (\S+)", run).group(1)
    for folder in folders:
        assert folder in made, folder
        assert folder.startswith(owned + "/"), folder
    assert stage.index("chown -R duplexrt") < stage.index("\nUSER duplexrt")


def test_the_compile_cache_is_a_volume_in_the_manifest_and_the_run_lines():
    env = _image_env()
    cache = os.path.commonpath([env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]])
    assert cache.endswith("/compile")
    pod = _kubernetes()["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == cache]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] in _claims()
    for line in _docker_run_lines():
        if "--gpus" in line:
            assert f":{cache}" in line, line


def _docker_run_lines() -> list[str]:
    """Every ``docker run`` of the image in the README, the operator guide and the Dockerfile's comments."""
    found = []
    for text in (README.read_text(), OPERATOR.read_text(), DOCKERFILE.read_text()):
        text = re.sub(r"\\\n[#\s]*", " ", text)
        found += [line for line in text.splitlines() if "docker run" in line and "duplexrt:" in line]
    return found


def test_the_run_lines_give_the_drain_its_time_and_the_health_check_a_first_load():
    """``docker stop`` waits 10 s before SIGKILL: the drain wants shutdown_grace_s (300 s by
    default) and two close timeouts.  A first start downloads ~15 GB and compiles before the port
    opens: the health check's start period is as long as Kubernetes' startup probe."""
    from duplexrt.config import Config

    server = Config().server
    lines = _docker_run_lines()
    assert len(lines) >= 4
    for line in lines:
        stop = re.search(r"--stop-timeout (\d+)", line)
        assert stop and int(stop.group(1)) >= server.shutdown_grace_s + 2 * server.close_timeout_s, line
    start = re.search(r"HEALTHCHECK .*--start-period=(\d+)(s|m)", _image_stage()).groups()
    seconds = int(start[0]) * (60 if start[1] == "m" else 1)
    probe = _kubernetes()["Deployment"]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert seconds >= probe["periodSeconds"] * probe["failureThreshold"] >= 1800


def test_the_docs_call_working_only_what_has_run():
    """HAProxy runs in CI (tests/test_deploy_haproxy.py); the Envoy file and the manifest are parsed
    and checked, never run: no sentence calls them working."""
    texts = [README.read_text(), OPERATOR.read_text(), (DEPLOY / "README.md").read_text()]
    for text in texts:
        for sentence in re.split(r"(?<=[.:;])\s", text.replace("\n", " ")):
            if "Envoy" in sentence or "Kubernetes configuration" in sentence:
                assert not re.search(r"\bworking\b", sentence), sentence
