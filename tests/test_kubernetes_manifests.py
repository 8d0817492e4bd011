"""deploy/kubernetes/ offline: every manifest validates against the Kubernetes (and vendored
CRD) schemas, every flag our containers pass parses with our CLI, every key comes from a
Secret, every probe names a route, and the drain fits the grace period."""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (test extra)")
import jsonschema  # noqa: E402
import kubernetes_validate  # noqa: E402

from radixserve.cli import build_parser, server_config_from  # noqa: E402
from radixserve.cli_args import field_names  # noqa: E402
from radixserve.config import (  # noqa: E402
    DisaggregationConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
)
from radixserve.config.keys import ADMIN_API_KEY_ENV, API_KEY_ENV  # noqa: E402
from radixserve.fleet.register import LEAVE_TIMEOUT_S  # noqa: E402
from radixserve.fleet.router_main import ROUTER_API_KEY_ENV  # noqa: E402
from radixserve.server.app import build_app  # noqa: E402
from radixserve.server.drain import ABORTED_WAIT_S  # noqa: E402
from radixserve.server.metrics import ENGINE_METRICS, ServerMetrics  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
_spec = importlib.util.spec_from_file_location("k8s_validate", DEPLOY / "validate.py")
k8s = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = k8s  # its dataclass looks its module up there
_spec.loader.exec_module(k8s)

MANIFESTS = k8s.load_manifests()
KEY_ENVS = {API_KEY_ENV, ADMIN_API_KEY_ENV, ROUTER_API_KEY_ENV}
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
"""What LeaderWorkerSet puts into every container of a group."""
ROUTER_COMMAND = ["python", "-m", "radixserve.fleet.router_main"]
SAMPLE_POD_IP = "10.1.2.3"


@dataclass(frozen=True)
class Container:
    """One container of a manifest's pod template, with what the kubelet gives it."""

    manifest: k8s.Manifest
    pod: dict  # the pod template's spec
    spec: dict
    injected: dict  # variables set outside the container's env (LWS), as sample values
    template: str = "template"  # LeaderWorkerSet: leaderTemplate | workerTemplate

    @property
    def name(self) -> str:
        return f"{self.manifest.name}/{self.template}/{self.spec['name']}"

    def args(self) -> list[str]:
        """The args as the kubelet runs them: $(NAME) expanded from env; sample values."""
        values = {**self.injected, **{e["name"]: sample_value(e) for e in self.spec.get("env", [])}}

        def expand(match: re.Match) -> str:
            assert match[1] in values, f"{self.name}: $({match[1]}) is not in its env"
            return values[match[1]]

        return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, a) for a in self.spec["args"]]


def sample_value(env: dict) -> str:
    if "value" in env:
        return env["value"]
    field = env["valueFrom"].get("fieldRef", {}).get("fieldPath")
    return SAMPLE_POD_IP if field == "status.podIP" else "sample-secret-value"


def containers() -> list[Container]:
    found = []
    for manifest in MANIFESTS:
        spec = manifest.doc.get("spec", {})
        if manifest.doc["kind"] == "LeaderWorkerSet":
            group = spec["leaderWorkerTemplate"]
            for index, template in enumerate(("leaderTemplate", "workerTemplate")):
                injected = {
                    "LWS_LEADER_ADDRESS": f"{manifest.doc['metadata']['name']}-0.example",
                    "LWS_GROUP_SIZE": str(group["size"]),
                    "LWS_WORKER_INDEX": str(index),
                }
                pod = group[template]["spec"]
                found += [
                    Container(manifest, pod, c, injected, template) for c in pod["containers"]
                ]
        elif "template" in spec:
            pod = spec["template"]["spec"]
            found += [Container(manifest, pod, c, {}) for c in pod["containers"]]
    return found


CONTAINERS = containers()
SERVE = [c for c in CONTAINERS if c.spec.get("command") == ["radixserve"]]
ROUTERS = [c for c in CONTAINERS if c.spec.get("command") == ROUTER_COMMAND]


def by_name(items: list, attr: str = "name"):
    return pytest.mark.parametrize("item", items, ids=[getattr(i, attr) for i in items])


def serve_option_strings() -> set[str]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


def parse_serve(container: Container):
    missing = [f for f in ("--nnodes", "--node-rank") if f in container.spec["args"]]
    missing = [f for f in missing if f not in serve_option_strings()]
    if missing:
        flags = ", ".join(missing)
        pytest.skip(f"`radixserve serve` has no {flags} yet (multi-node TP, issue #30 item 6)")
    try:
        return build_parser().parse_args(container.args())
    except SystemExit:
        pytest.fail(f"{container.name}: its args do not parse with `radixserve serve`")


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ---- schemas -------------------------------------------------------------------------


def test_every_file_is_loaded_and_every_kind_has_a_schema():
    kinds = {m.doc["kind"] for m in MANIFESTS}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "LeaderWorkerSet"} <= kinds
    assert {"ScaledObject", "ConfigMap", "NetworkPolicy"} <= kinds
    assert {m.path for m in MANIFESTS} == set(k8s.manifest_files())


@by_name(MANIFESTS)
def test_manifest_validates(item):
    k8s.validate(item.doc)


def test_validator_rejects_unknown_fields_in_core_and_custom_kinds():
    worker = objects("Deployment")["radixserve-worker"]
    lws = next(m for m in MANIFESTS if m.doc["kind"] == "LeaderWorkerSet")
    scaled = next(m for m in MANIFESTS if m.doc["kind"] == "ScaledObject")
    bad_worker = yaml.safe_load(yaml.safe_dump(worker))
    bad_worker["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    bad_lws = yaml.safe_load(yaml.safe_dump(lws.doc))  # inside the pod template: core schema
    bad_lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["arg"] = []
    bad_scaled = yaml.safe_load(yaml.safe_dump(scaled.doc))
    bad_scaled["spec"]["triggers"][0]["treshold"] = "4"
    for doc in (bad_worker, bad_lws, bad_scaled):
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            k8s.validate(doc)


# ---- our command lines ---------------------------------------------------------------


@by_name(SERVE)
def test_serve_args_parse_and_verify_with_our_cli(item):
    args = parse_serve(item)
    assert args.command == "serve"
    server = server_config_from(args)  # SystemExit on a bad combination
    parallel = ParallelConfig(**{n: getattr(args, n) for n in field_names(ParallelConfig)})
    parallel.verify()
    disagg = DisaggregationConfig(
        **{n: getattr(args, n) for n in field_names(DisaggregationConfig)}
    )
    scheduler = SchedulerConfig(**{n: getattr(args, n) for n in field_names(SchedulerConfig)})
    disagg.verify(scheduler, parallel.tp_size)
    if server.router_url is not None:
        assert server.advertise_url == f"http://{SAMPLE_POD_IP}:{server.port}"


@by_name(ROUTERS)
def test_router_args_parse_with_sglang_router(item):
    # the parser launch_router.parse_router_args builds (its module imports a web stack)
    router_args = pytest.importorskip("sglang_router.router_args")
    parser = argparse.ArgumentParser(exit_on_error=False)
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    namespace = parser.parse_args(item.args())
    args = router_args.RouterArgs.from_cli_args(namespace, use_router_prefix=False)
    assert args.pd_disaggregation == ("pd/" in item.manifest.name)
    assert args.prometheus_host == "0.0.0.0"  # scraped from other pods


def test_lws_groups_split_tp_over_their_nodes():
    for c in (c for c in SERVE if c.manifest.doc["kind"] == "LeaderWorkerSet"):
        size = c.manifest.doc["spec"]["leaderWorkerTemplate"]["size"]
        assert flag_value(c.spec["args"], "--nnodes") == "$(LWS_GROUP_SIZE)"
        assert int(flag_value(c.spec["args"], "--tp-size")) % size == 0
        assert flag_value(c.spec["args"], "--dist-init-addr").startswith("$(LWS_LEADER_ADDRESS):")


@by_name(CONTAINERS)
def test_keys_come_from_secrets_and_every_env_var_is_used(item):
    args = " ".join(item.spec["args"])
    assert not re.search(r"--(admin-)?api-key(\s|=|$)", args), f"{item.name}: a key in args"
    for env in item.spec.get("env", []):
        if env["name"] in KEY_ENVS:
            assert "secretKeyRef" in env.get("valueFrom", {}), f"{item.name}: {env['name']}"
        else:  # anything else is there to be expanded in args
            assert f"$({env['name']})" in args, f"{item.name}: {env['name']} is not used"
    env_names = {e["name"] for e in item.spec.get("env", [])}
    if item in ROUTERS:
        assert ROUTER_API_KEY_ENV in env_names
    elif "--router-url" in item.spec["args"]:
        assert API_KEY_ENV in env_names  # the router sends it to this worker


# ---- probes, ports and the drain -----------------------------------------------------


def worker_routes() -> set[str]:
    app = build_app(SimpleNamespace(config=ServerConfig()))
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET"}


def router_binary_has(path: str) -> bool:
    spec = importlib.util.find_spec("sglang_router")
    binary = next(Path(spec.origin).parent.glob("sglang_router_rs*.so"))
    with open(binary, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(path.encode()) >= 0


def probes(container: Container) -> list[dict]:
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    return [container.spec[k] for k in kinds if k in container.spec]


@by_name(SERVE + ROUTERS)
def test_probes_name_routes_on_a_declared_port(item):
    ports = {p["name"]: p["containerPort"] for p in item.spec.get("ports", [])}
    args = item.args()
    for probe in probes(item):
        path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
        assert ports[port] == int(flag_value(args, "--port")), f"{item.name}: probe port"
        if item in SERVE:
            assert path in worker_routes(), f"{item.name}: no GET {path}"
        elif importlib.util.find_spec("sglang_router") is not None:
            assert router_binary_has(path), f"{item.name}: sglang-router has no {path}"
    serves_http = item in ROUTERS or "--port" in item.spec["args"]
    assert bool(probes(item)) == serves_http, f"{item.name}: probes iff it serves HTTP"


def drain_budget_s(container: Container) -> float:
    """preStop, then SIGTERM: leave the router, --drain-timeout, the aborted requests' wait."""
    args = container.spec["args"]
    pre_stop = container.spec.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    leave = LEAVE_TIMEOUT_S if "--router-url" in args else 0
    drain = float(flag_value(args, "--drain-timeout") or ServerConfig.drain_timeout)
    return pre_stop.get("seconds", 0) + leave + drain + ABORTED_WAIT_S


@by_name([c for c in SERVE if "--port" in c.spec["args"]])
def test_the_grace_period_covers_the_drain_and_liveness_waits_it_out(item):
    grace = item.pod["terminationGracePeriodSeconds"]
    assert grace >= drain_budget_s(item), f"{item.name}: SIGKILL would cut the drain short"
    liveness = item.spec["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= grace


def test_lws_ranks_outlive_their_leaders_drain():
    lws = [c for c in SERVE if c.manifest.doc["kind"] == "LeaderWorkerSet"]
    leader = next(c for c in lws if "--port" in c.spec["args"])
    for rank in (c for c in lws if c is not leader):
        sleep_s = rank.spec["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert drain_budget_s(leader) <= sleep_s < rank.pod["terminationGracePeriodSeconds"]


def test_pd_secret_is_a_private_secret_file():
    pd = [c for c in SERVE if "--disaggregation-mode" in c.spec["args"]]
    modes = {flag_value(c.spec["args"], "--disaggregation-mode") for c in pd}
    assert modes == {"prefill", "decode"}
    for c in pd:
        path = Path(flag_value(c.spec["args"], "--disaggregation-secret-file"))
        mount = next(m for m in c.spec["volumeMounts"] if path.parent == Path(m["mountPath"]))
        volume = next(v for v in c.pod["volumes"] if v["name"] == mount["name"])["secret"]
        assert [i["path"] for i in volume["items"]] == [path.name]
        assert volume["defaultMode"] & 0o077 == 0, f"{c.name}: group/others may read it"
        security = c.pod.get("securityContext", {})  # fsGroup would add group read
        assert "fsGroup" not in security and security.get("runAsUser", 0) == 0
        if flag_value(c.spec["args"], "--disaggregation-mode") == "prefill":
            port = int(flag_value(c.spec["args"], "--disaggregation-bootstrap-port"))
            assert port in {p["containerPort"] for p in c.spec["ports"]}


# ---- wiring between the objects ------------------------------------------------------


def objects(kind: str) -> dict[str, dict]:
    return {m.doc["metadata"]["name"]: m.doc for m in MANIFESTS if m.doc["kind"] == kind}


def test_router_urls_name_a_router_service_and_port():
    services = objects("Service")
    router_pods = [r.manifest.doc["spec"]["template"]["metadata"]["labels"] for r in ROUTERS]
    for c in (c for c in SERVE if "--router-url" in c.spec["args"]):
        host, port = flag_value(c.spec["args"], "--router-url").split("//")[1].split(":")
        service = services[host]["spec"]
        assert int(port) in {p["port"] for p in service["ports"]}, f"{c.name}: port {port}"
        assert any(service["selector"].items() <= labels.items() for labels in router_pods)
    pd_urls = {flag_value(c.spec["args"], "--router-url") for c in SERVE if "pd/" in c.name}
    assert pd_urls == {"http://radixserve-pd-router:30000"}


TTFT = "radixserve:time_to_first_token_seconds"


def adapter_rules() -> list[dict]:
    config = objects("ConfigMap")["adapter-config"]["data"]["config.yaml"]
    return yaml.safe_load(config)["rules"]


def exported_series() -> tuple[set[str], set[str]]:
    """The series a worker's /metrics has (histograms' _bucket / _count / _sum included) and
    the `le` bounds of its TTFT histogram."""
    samples = [x for family in ServerMetrics().registry.collect() for x in family.samples]
    ttft_bounds = {x.labels["le"] for x in samples if x.name == TTFT + "_bucket"}
    return {x.name for x in samples}, ttft_bounds


def family(series: str) -> str:
    return re.sub(r"_(bucket|count|sum)$", "", series)


def test_autoscalers_read_metrics_the_workers_export():
    exported, ttft_bounds = exported_series()
    exported |= {name for name, _, _ in ENGINE_METRICS.values()}  # counters without _total
    renamed = {}
    for rule in adapter_rules():
        series = rule["seriesQuery"].split("{")[0].strip("'")
        assert series in exported and re.fullmatch(rule["name"]["matches"], series)
        assert set(re.findall(r"radixserve:\w+", rule["metricsQuery"])) <= exported
        renamed[rule["name"]["as"]] = family(series)
    assert "radixserve:num_requests_waiting" in renamed.values()
    hpa = objects("HorizontalPodAutoscaler")["radixserve-worker"]["spec"]
    hpa_targets = {
        renamed[m["pods"]["metric"]["name"]]: m["pods"]["target"]["averageValue"]
        for m in hpa["metrics"]
    }
    scaled = objects("ScaledObject")["radixserve-worker"]["spec"]
    keda_targets = {}
    for trigger in scaled["triggers"]:
        found = set(re.findall(r"radixserve:\w+", trigger["metadata"]["query"]))
        assert found <= exported
        (name,) = {family(series) for series in found}
        keda_targets[name] = trigger["metadata"]["threshold"]
    assert hpa_targets == keda_targets  # one policy, two ways
    # the fleet autoscaler's TTFT signal, in both: one target, a bound of the histogram
    assert TTFT in hpa_targets
    queries = [r["metricsQuery"] for r in adapter_rules() if TTFT in r["metricsQuery"]]
    queries += [q for t in scaled["triggers"] if TTFT in (q := t["metadata"]["query"])]
    (bound,) = {le for query in queries for le in re.findall(r'le="([^"]+)"', query)}
    assert len(queries) == 2 and bound in ttft_bounds
    deployments = objects("Deployment")
    for ref in (hpa["scaleTargetRef"], scaled["scaleTargetRef"]):
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
    assert hpa["minReplicas"] <= hpa["maxReplicas"]
    assert scaled["minReplicaCount"] <= scaled["maxReplicaCount"]  # the CRD's CEL rule
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (
        scaled["minReplicaCount"],
        scaled["maxReplicaCount"],
    )


def test_readme_names_every_file_and_creates_every_secret():
    readme = (DEPLOY / "README.md").read_text()
    for path in k8s.manifest_files():
        assert f"`{path.relative_to(DEPLOY)}`" in readme, f"README.md: {path.name}"
    created = set(re.findall(r"kubectl create secret generic (\S+) --from-\w+=(\w[\w-]*)", readme))
    used = set()
    for c in CONTAINERS:
        used |= {
            (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.spec.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for volume in c.pod.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                used |= {(name, item["key"]) for item in volume["secret"]["items"]}
    assert used and used <= created, f"README.md does not create {used - created}"
