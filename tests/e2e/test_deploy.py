"""The sidecar image's recipe, checked without a container engine (none runs here): its
shape (multi-stage, non-root, exec-form entrypoint, STOPSIGNAL, HEALTHCHECK, the
dependencies in a layer before the source, torch only in the CUDA variant), the
server's dependency list it installs against pyproject's, and its entrypoint and
healthcheck commands run as plain commands with the image's environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import short_tmpdir

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last(name: str) -> str:
    return [rest for word, rest in instructions() if word == name][-1]


def runtime_stage() -> list[tuple[str, str]]:
    ins = instructions()
    froms = [i for i, (word, _) in enumerate(ins) if word == "FROM"]
    assert len(froms) >= 2, "a multi-stage build: a build stage and a small runtime"
    return ins[froms[-1] :]


def test_the_runtime_is_small_non_root_and_exec_form() -> None:
    stage = runtime_stage()
    words = [word for word, _ in stage]
    assert "USER" in words, "the runtime runs as a user of its own"
    user = [rest for word, rest in stage if word == "USER"][-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    for name in ("ENTRYPOINT", "CMD"):
        assert isinstance(json.loads(last(name)), list), f"{name} must be exec form (a JSON array)"
    assert last("STOPSIGNAL") == "SIGTERM"
    health = last("HEALTHCHECK")
    assert health.split(" CMD ", 1)[1].startswith("["), "HEALTHCHECK CMD in exec form"
    assert not any(word == "COPY" and "--from=build" not in rest for word, rest in stage), (
        "the runtime copies only the build"
    )


def test_dependencies_come_before_the_source_and_torch_only_in_the_cuda_variant() -> None:
    ins = instructions()
    copies = [rest for word, rest in ins if word == "COPY"]
    first_source = next(i for i, c in enumerate(copies) if c.startswith("server"))
    assert any("requirements-server.txt" in c for c in copies[:first_source])
    torch_runs = [rest for word, rest in ins if word == "RUN" and "torch" in rest]
    assert torch_runs and all('"$VARIANT" = "cuda"' in r and "torch==${TORCH_VERSION}" in r for r in torch_runs)
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", DOCKERFILE), "torch pinned to the tested version"
    assert "--no-deps /src" in DOCKERFILE, "kvmem itself without its dependencies (torch among them)"


def test_the_image_copies_every_folder_the_package_is_built_from() -> None:
    """``pip install /src`` builds every package of pyproject's package-dir: a folder the
    image does not copy (a new application) would fail the build."""
    folders = {
        where.split("/")[0]
        for where in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    }
    copied = {rest.split()[0] for word, rest in instructions() if word == "COPY" and "--from" not in rest}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"


def test_the_server_requirements_are_pyprojects_less_torch() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    listed = [
        line.strip()
        for line in (ROOT / "deploy" / "requirements-server.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sorted(listed) == sorted(d for d in deps if not d.startswith("torch"))


def test_the_entrypoint_and_healthcheck_as_plain_commands() -> None:
    """``ENTRYPOINT + CMD`` and the HEALTHCHECK's command, with the image's KVMEM_SOCKET."""
    directory = short_tmpdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env["KVMEM_SOCKET"] = os.path.join(directory, "kvmem.sock")
    env["KVMEM_SHM_DIR"] = directory
    bin_dir = Path(sys.executable).parent
    entry = json.loads(last("ENTRYPOINT")) + json.loads(last("CMD"))
    health = json.loads(last("HEALTHCHECK").split(" CMD ", 1)[1])
    assert entry[0] == health[0] == "kvmem"
    exe = str(bin_dir / "kvmem")
    proc = subprocess.Popen([exe, *entry[1:]], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        code = 1
        for _ in range(60):
            code = subprocess.run([exe, *health[1:]], env=env, capture_output=True, timeout=10).returncode
            if code == 0:
                break
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            subprocess.run(["sleep", "0.5"])
        assert code == 0, "the healthcheck never passed"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out.decode()


# --------------------------------------------------------------- Kubernetes


def manifest() -> dict:
    yaml = __import__("yaml")
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "engine-with-kvmem.yaml").read_text()))
    assert len(docs) == 1 and docs[0]["kind"] == "Deployment"
    return docs[0]


def serve_help() -> str:
    exe = str(Path(sys.executable).parent / "kvmem")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    out = subprocess.run([exe, "serve", "--help"], env=env, capture_output=True, text=True, check=True).stdout
    return " ".join(out.split())  # argparse wraps lines anywhere


def option_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_kubernetes_example_names_only_what_exists() -> None:
    spec = manifest()["spec"]["template"]["spec"]
    [kvmem] = [c for c in spec.get("initContainers", []) if c["name"] == "kvmem"]
    assert kvmem["restartPolicy"] == "Always", "a native sidecar: starts first, stops last"
    help_text = serve_help()
    args = kvmem["args"]
    assert args[0] == "serve"
    for arg in args[1:]:
        if arg.startswith("--"):
            assert arg in help_text, f"{arg} is not a kvmem serve option"
    env = {e["name"]: e["value"] for e in kvmem["env"]}
    for name in env:
        assert f"env {name})" in help_text or f"env {name};" in help_text, f"{name} is no kvmem serve variable"
    # Probes on the health-only port; metrics on the metrics port; the ports declared.
    health = int(option_value(args, "--health-port"))
    metrics = int(option_value(args, "--metrics").rsplit(":", 1)[1])
    declared = {p["containerPort"] for p in kvmem["ports"]}
    assert {health, metrics} <= declared
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kvmem[probe]["grpc"]["port"] == health
    assert kvmem["readinessProbe"]["grpc"]["service"] == "kvmem.v1.KVMemory"
    # The socket and /dev/shm shared with the engine; /dev/shm memory-backed and big
    # enough for the pool.
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in kvmem["volumeMounts"]}
    assert os.path.dirname(env["KVMEM_SOCKET"]) == mounts["kvmem-socket"] and env["KVMEM_SHM_DIR"] == mounts["dshm"]
    [engine] = spec["containers"]
    assert {m["name"]: m["mountPath"] for m in engine["volumeMounts"]} == mounts
    assert {e["name"]: e["value"] for e in engine["env"]}["KVMEM_SOCKET"] == env["KVMEM_SOCKET"]
    mib = {"Mi": 1, "Gi": 1024}
    size = volumes["dshm"]["emptyDir"]["sizeLimit"]
    pool = env["KVMEM_MEMORY"]
    assert int(size[:-2]) * mib[size[-2:]] > int(pool[:-3]) * mib[pool[-3:-1]], "the shm volume holds the pool"
    assert kvmem["resources"]["limits"]["memory"] and kvmem["resources"]["requests"]["cpu"]


def test_the_kubernetes_sidecar_answers_its_probes() -> None:
    """The sidecar's args and env as the manifest has them (paths moved to a temporary
    directory, ports to free ones): the health-only port answers readiness and
    liveness, and serves nothing else."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

    spec = manifest()["spec"]["template"]["spec"]
    [kvmem] = spec["initContainers"]
    directory = short_tmpdir()
    health_port, metrics_port = free_port(), free_port()
    args = list(kvmem["args"])
    args[args.index("--health-port") + 1] = str(health_port)
    args[args.index("--metrics") + 1] = f"127.0.0.1:{metrics_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env.update({e["name"]: e["value"] for e in kvmem["env"]})
    env["KVMEM_SOCKET"] = os.path.join(directory, "kvmem.sock")
    env["KVMEM_SHM_DIR"] = directory
    env["KVMEM_MEMORY"] = "16MiB"  # a small pool for the test machine
    exe = str(Path(sys.executable).parent / "kvmem")
    proc = subprocess.Popen([exe, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = None
            for _ in range(120):
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service="kvmem.v1.KVMemory"), timeout=2).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                subprocess.run(["sleep", "0.25"])
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == status
            try:
                kvmem_pb2_grpc.KVMemoryStub(channel).Stats(kvmem_pb2.StatsRequest(), timeout=2)
                raise AssertionError("the health port serves kvmem's service")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_pool_that_cannot_fit_dev_shm_is_refused_in_one_line() -> None:
    """A container's default 64 MiB /dev/shm (a tmpfs of that size here) cannot hold
    the default pool: the start is refused at once, in one line naming the flags."""
    directory = short_tmpdir()
    shm = os.path.join(directory, "shm")
    os.mkdir(shm)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", shm], capture_output=True)
    if mounted.returncode != 0:
        import pytest

        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        cmd = [str(Path(sys.executable).parent / "kvmem"), "serve", "--socket", os.path.join(directory, "s.sock"),
               "--shm-dir", shm]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
        assert done.returncode == 2 and len(errors) == 1, done.stderr
        assert "--num-pages/--memory" in errors[0] and "--shm-size" in errors[0]
        assert os.listdir(shm) == []
    finally:
        subprocess.run(["umount", shm], capture_output=True)


def test_the_store_example_parses_and_its_urls_name_its_services() -> None:
    """``deploy/kubernetes/store.yaml`` (a store beside the sidecars): it parses, the
    URLs its header gives the sidecars name its Services and ports, every KVMEM_* the
    DEPLOY page tells the sidecar to set is a ``kvmem serve`` option, and the URLs are
    ones kvmem's store adapters take."""
    yaml = __import__("yaml")
    text = (ROOT / "deploy" / "kubernetes" / "store.yaml").read_text()
    docs = list(yaml.safe_load_all(text))
    services = {d["metadata"]["name"]: d["spec"]["ports"][0]["port"] for d in docs if d["kind"] == "Service"}
    assert services == {"kvmem-valkey": 6379, "kvmem-mooncake-master": 50051}, services
    assert "KVMEM_STORE=redis://kvmem-valkey:6379" in text
    assert "KVMEM_STORE=mooncake://kvmem-mooncake-master:50051?protocol=tcp" in text
    from kvmem.server.store.base import StoreURL

    for url in ("redis://kvmem-valkey:6379", "mooncake://kvmem-mooncake-master:50051?protocol=tcp"):
        assert StoreURL.parse(url).hosts[0][0] in services
    page = (ROOT / "docs" / "DEPLOY.md").read_text()
    section = page[page.index("## A store every node shares") :]
    section = section[: section.index("\n## ")]
    named = set(re.findall(r"KVMEM_[A-Z_]+", section)) - {"KVMEM_STORE_PASSWORD"}  # that one is the password itself
    help_text = serve_help()
    for env in sorted(named):
        flag = "--" + env.removeprefix("KVMEM_").lower().replace("_", "-")
        assert flag in help_text, f"{env} in docs/DEPLOY.md is no kvmem serve option ({flag})"
