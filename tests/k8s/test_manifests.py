"""The Kubernetes manifests of k8s/, checked without a cluster.

Every overlay is rendered with `kubectl kustomize`; built-in kinds are validated against the
Kubernetes strict schemas bundled with kubernetes-validate, PyTorchJob against the schema kept in
k8s/schemas/; then the project's rules: GPU limits, a memory-backed /dev/shm, credentials only
from the Secret, pinned images, the demo's entry point under torchrun, NCCL_NVLS_ENABLE=0, and
resize overlays that change only the size. Rendering tests skip when kubectl is missing
(k8s/install-kubectl.sh installs it).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = K8S / "schemas"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
FORMS = ("pytorchjob", "indexed-job")
JOB_NAME = "nvdcp-train"
SECRET_NAME = "nvdcp-s3-credentials"
SETTINGS = "nvdcp-train-settings"
SECRET_LIKE = re.compile(r"KEY|SECRET|TOKEN|PASSWORD", re.IGNORECASE)
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Set in every container of a PyTorchJob by the training operator (v1.7+, with a Master).
OPERATOR_ENV = {
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "PYTHONUNBUFFERED",
}


def _load_build_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_pytorchjob_schema", SCHEMAS / "build_pytorchjob_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_schema = _load_build_script()


def kubectl_path() -> str | None:
    """$KUBECTL, kubectl on PATH, or the one pip put beside this interpreter."""
    candidates = [
        os.environ.get("KUBECTL"),
        shutil.which("kubectl"),
        str(Path(sys.executable).parent / "kubectl"),
    ]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@functools.cache
def render(target: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize k8s/<target>` prints (cached: rendering is the slow part)."""
    kubectl = kubectl_path()
    if kubectl is None:
        pytest.skip("kubectl not found (run k8s/install-kubectl.sh)")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def overlay(name: str) -> tuple[dict[str, Any], ...]:
    return render(f"overlays/{name}")


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any] | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def training_pods(docs: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every training pod template: PyTorchJob replicas and the Indexed Job."""
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                yield f"PyTorchJob/{role}", replica["template"]["spec"]
        elif doc["kind"] == "Job" and doc["metadata"]["name"] == JOB_NAME:
            yield "Job", doc["spec"]["template"]["spec"]


def trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == "pytorch")


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def all_containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every container and init container anywhere in a rendered object."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from all_containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from all_containers(value)


def world_of(docs: tuple[dict[str, Any], ...]) -> tuple[int, int]:
    """(pods, processes per pod) of the training job in an overlay."""
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            spec = doc["spec"]
            return sum(r.get("replicas", 1) for r in spec["pytorchReplicaSpecs"].values()), int(
                spec["nprocPerNode"]
            )
        if doc["kind"] == "Job" and doc["metadata"]["name"] == JOB_NAME:
            env = env_of(trainer(doc["spec"]["template"]["spec"]))
            assert int(env["PET_NNODES"]["value"]) == doc["spec"]["completions"] == doc["spec"]["parallelism"]
            return doc["spec"]["completions"], int(env["PET_NPROC_PER_NODE"]["value"])
    raise AssertionError("no training job")


def option(args: list[str], flag: str) -> str:
    """The value after `flag` in an argument list (both `--x v` and `--x=v`)."""
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {args}")


# -- rendering and schemas ---------------------------------------------------------------------------------


def test_the_expected_overlays_exist() -> None:
    expected = {
        "pytorchjob",
        "indexed-job",
        "pytorchjob-resize-3",
        "indexed-job-resize-3",
        "aws-s3-pytorchjob",
        "aws-s3-indexed-job",
    }
    assert expected <= set(OVERLAYS)


@pytest.mark.parametrize("target", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_renders_and_labels_everything(target: str) -> None:
    docs = render(target)
    assert docs
    for doc in docs:
        assert doc["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "nvdcp", doc["metadata"]


@pytest.mark.parametrize("target", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_builtin_kinds_match_the_kubernetes_schemas(target: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in render(target):
        if doc["apiVersion"].startswith("kubeflow.org/"):
            continue
        try:
            kv.validate(doc, build_schema.KUBERNETES_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(
                f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.absolute_path)}"
            )


@functools.cache
def pytorchjob_validator() -> Any:
    schema = json.loads((SCHEMAS / "pytorchjob_v1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_pytorchjob_schema_is_up_to_date() -> None:
    pytest.importorskip("kubernetes_validate")
    committed = (SCHEMAS / "pytorchjob_v1.schema.json").read_text()
    assert committed == build_schema.render(build_schema.build()), (
        "stale: run python k8s/schemas/build_pytorchjob_schema.py"
    )


@pytest.mark.parametrize("name", [o for o in OVERLAYS if "pytorchjob" in o])
def test_pytorchjob_matches_its_crd_schema(name: str) -> None:
    jobs = [d for d in overlay(name) if d["kind"] == "PyTorchJob"]
    assert len(jobs) == 1
    errors = [f"{e.message} at {list(e.absolute_path)}" for e in pytorchjob_validator().iter_errors(jobs[0])]
    assert not errors, errors


def _break(path: str, value: Any) -> Any:
    def mutate(job: dict[str, Any]) -> dict[str, Any]:
        job = copy.deepcopy(job)
        *parents, last = path.split("/")
        node = job
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
        return job

    return mutate


WORKER_POD = "spec/pytorchReplicaSpecs/Worker/template/spec"


@pytest.mark.parametrize(
    "mutate",
    [
        _break("spec/pytorchReplicaSpecs/Worker/replica", 2),  # typo of replicas
        _break("spec/pytorchReplicaSpecs/Worker/restartPolicy", "Sometimes"),
        _break("spec/pytorchReplicaSpecs/Chief", {"replicas": 1}),  # not a PyTorch replica type
        _break("spec/pytorchReplicaSpecs/Master/replicas", 2),  # one Master only
        _break(f"{WORKER_POD}/containers/0/name", "main"),  # no container named pytorch
        _break(f"{WORKER_POD}/containers/0/imagePullPolicyy", "Always"),  # typo inside the pod template
        _break(f"{WORKER_POD}/volumes/0/emptyDir/medum", "Memory"),
        _break("spec/nprocPerNode", 8),  # a string in the CRD
        _break("spec/pytorchReplicaSpecs", KeyError),
        _break("metadata/name", "Not_A_DNS_Label"),
    ],
    ids=[
        "replica",
        "restartPolicy",
        "Chief",
        "two-masters",
        "no-pytorch-container",
        "pod-typo",
        "volume-typo",
        "nproc-int",
        "no-replica-specs",
        "bad-name",
    ],
)
def test_pytorchjob_schema_rejects_broken_jobs(mutate: Any) -> None:
    job = next(d for d in overlay("pytorchjob") if d["kind"] == "PyTorchJob")
    assert not list(pytorchjob_validator().iter_errors(job))
    assert list(pytorchjob_validator().iter_errors(mutate(job)))


# -- the project's rules for training pods ------------------------------------------------------------------


@pytest.mark.parametrize("name", OVERLAYS)
def test_training_pods_have_gpus_shm_and_no_nvls(name: str) -> None:
    docs = overlay(name)
    pods, nproc = world_of(docs)
    assert pods >= 1
    for where, pod in training_pods(docs):
        main = trainer(pod)
        gpus = main["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus is not None and int(gpus) == nproc, (
            f"{where}: nvidia.com/gpu {gpus} != {nproc} processes per pod"
        )
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        shm = [m for m in main.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1, f"{where}: /dev/shm not mounted"
        empty_dir = volumes[shm[0]["name"]].get("emptyDir", {})
        assert empty_dir.get("medium") == "Memory" and empty_dir.get("sizeLimit"), f"{where}: {empty_dir}"
        assert env_of(main)["NCCL_NVLS_ENABLE"].get("value") == "0", where
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), where


@functools.cache
def settings(name: str) -> dict[str, str]:
    config_map = find(overlay(name), "ConfigMap", SETTINGS)
    assert config_map is not None
    return dict(config_map["data"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_command_is_the_demo_entry_point_under_torchrun(name: str) -> None:
    docs = overlay(name)
    pods, nproc = world_of(docs)
    for where, pod in training_pods(docs):
        main = trainer(pod)
        assert main["command"] == ["torchrun"], where
        args = main["args"]
        module = args.index("-m")
        assert args[module + 1] == "nvdcp.demo.train", where
        torchrun_args, train_args = args[:module], args[module + 2 :]
        assert option(torchrun_args, "--nnodes") == "$(PET_NNODES)"
        assert option(torchrun_args, "--nproc-per-node") == "$(PET_NPROC_PER_NODE)"
        assert option(train_args, "--ckpt-root") == "$(NVDCP_CKPT_ROOT)"
        assert settings(name)["NVDCP_CKPT_ROOT"].startswith("s3://")
        assert option(train_args, "--keep-last") == "3"
        assert int(option(train_args, "--save-every")) > 0 and int(option(train_args, "--steps")) > 0
        assert int(option(train_args, "--global-batch")) % (pods * nproc) == 0, (
            "global batch must divide by world"
        )


def test_both_forms_run_the_same_command() -> None:
    commands = {
        (form, where): (trainer(pod)["command"], trainer(pod)["args"])
        for form in FORMS
        for where, pod in training_pods(overlay(form))
    }
    assert len(set(map(json.dumps, commands.values()))) == 1, commands


def test_pytorchjob_master_and_worker_templates_are_the_same() -> None:
    job = next(d for d in overlay("pytorchjob") if d["kind"] == "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    assert specs["Master"]["restartPolicy"] == specs["Worker"]["restartPolicy"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_variable_reference_resolves(name: str) -> None:
    docs = overlay(name)
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for where, pod in training_pods(docs):
        for container in pod["containers"] + pod.get("initContainers", []):
            known = set(env_of(container))
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef")
                assert ref and ref["name"] in config_maps, f"{where}: envFrom {source} not rendered here"
                known |= set(config_maps[ref["name"]])
            if where.startswith("PyTorchJob"):
                known |= OPERATOR_ENV
            used = {
                v
                for arg in container.get("command", []) + container.get("args", [])
                for v in VAR_REF.findall(arg)
            }
            assert used <= known, f"{where}/{container['name']}: undefined {sorted(used - known)}"


@pytest.mark.parametrize("name", [o for o in OVERLAYS if "pytorchjob" in o])
def test_pytorchjob_fits_the_operator(name: str) -> None:
    job = next(d for d in overlay(name) if d["kind"] == "PyTorchJob")
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}  # Master: PET_MASTER_ADDR, ranks
    for _, pod in training_pods((job,)):
        ports = {p["name"]: p["containerPort"] for p in trainer(pod).get("ports", [])}
        assert "pytorchjob-port" in ports  # becomes PET_MASTER_PORT
        assert not {"PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR"} & set(env_of(trainer(pod)))


@pytest.mark.parametrize("name", [o for o in OVERLAYS if "indexed-job" in o])
def test_indexed_job_rendezvous(name: str) -> None:
    docs = overlay(name)
    job, service = find(docs, "Job", JOB_NAME), find(docs, "Service", JOB_NAME)
    assert job is not None and service is not None
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"].get("publishNotReadyAddresses") is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": JOB_NAME}
    env = env_of(trainer(pod))
    assert env["PET_MASTER_ADDR"]["value"] == f"{JOB_NAME}-0.{service['metadata']['name']}"
    port = int(env["PET_MASTER_PORT"]["value"])
    assert port in {p["port"] for p in service["spec"]["ports"]}
    assert port in {p["containerPort"] for p in trainer(pod)["ports"]}
    field = env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.annotations['batch.kubernetes.io/job-completion-index']"


# -- credentials -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_no_literal_secrets(target: str) -> None:
    docs = render(target)
    assert not [d for d in docs if d["kind"] == "Secret"], "Secrets are created out of band"
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ConfigMap":
            assert not [k for k in doc.get("data", {}) if SECRET_LIKE.search(k)], where
        for container in all_containers(doc):
            for env in container.get("env", []):
                if SECRET_LIKE.search(env["name"]):
                    assert "value" not in env, f"{where}/{container['name']}: literal {env['name']}"
                    assert env["valueFrom"]["secretKeyRef"]["name"] == SECRET_NAME, where
            for source in container.get("envFrom", []):
                assert "secretRef" not in source or source["secretRef"]["name"] == SECRET_NAME


def test_no_secret_generators_or_keys_in_the_sources() -> None:
    aws_key_id = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
    for path in K8S.rglob("*"):
        if path.suffix not in {".yaml", ".yml", ".env", ".txt", ".py", ".sh", ""} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        assert not aws_key_id.search(text), path
        if path.name == "kustomization.yaml":
            assert "secretGenerator" not in yaml.safe_load(text), path


@pytest.mark.parametrize("form", FORMS)
def test_minio_is_the_default_s3_and_aws_drops_it(form: str) -> None:
    minio, aws = overlay(form), overlay(f"aws-s3-{form}")
    statefulset = find(minio, "StatefulSet", "minio")
    assert statefulset is not None and find(minio, "Service", "minio") is not None
    assert find(minio, "Job", "nvdcp-minio-bucket") is not None
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"] for m in statefulset["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert claims and claims <= mounts
    assert settings(form)["AWS_ENDPOINT_URL"] == "http://minio:9000"

    assert not [d for d in aws if d["metadata"]["name"] in {"minio", "nvdcp-minio-bucket"}]
    assert "AWS_ENDPOINT_URL" not in settings(f"aws-s3-{form}")
    for where, pod in training_pods(aws):
        for container in [trainer(pod), *pod.get("initContainers", [])]:
            ref = env_of(container)["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == SECRET_NAME and ref.get("optional") is True, where


# -- images -------------------------------------------------------------------------------------------------


def pinned(image: str) -> bool:
    name, _, digest = image.partition("@")
    if digest:
        return digest.startswith("sha256:")
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    return bool(tag) and tag != "latest"


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_are_pinned(name: str) -> None:
    docs = overlay(name)
    images = {c["image"] for d in docs for c in all_containers(d)}
    assert images and all(pinned(i) for i in images), images
    training = {
        c["image"]
        for _, pod in training_pods(docs)
        for c in pod["containers"] + pod.get("initContainers", [])
    }
    assert len(training) == 1, training  # one training image everywhere


def test_dockerfile_pins_its_base_and_packages() -> None:
    dockerfile = (K8S / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile, re.MULTILINE))
    bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], b)
        for b in re.findall(r"^FROM (\S+)", dockerfile, re.M)
    ]
    assert bases and all(pinned(b) for b in bases), bases
    constraints = {}
    for line in (K8S / "image-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"not pinned: {line}"
            constraints[name.lower().replace("_", "-")] = version
    for wanted in ("torch", "nvidia-nvcomp-cu12", "nvidia-libnvcomp-cu12", "boto3", "s3fs", "pip"):
        assert wanted in constraints
    for name, version in re.findall(r"\b([A-Za-z0-9_.-]+)==([0-9][^\s\"']*)", dockerfile):
        assert constraints.get(name.lower()) == version, (
            f"Dockerfile pins {name}=={version}, constraints disagree"
        )
    assert constraints["nvidia-nvcomp-cu12"] == constraints["nvidia-libnvcomp-cu12"] == "6.0.0.12"
    assert '"/src[gpu,s3]"' in dockerfile and "PIP_CONSTRAINT=/opt/nvdcp/image-constraints.txt" in dockerfile
    # The init containers run the script where the image puts it.
    assert "COPY k8s/wait_for_bucket.py /opt/nvdcp/wait_for_bucket.py" in dockerfile
    ignore = (K8S / "Dockerfile.dockerignore").read_text().split()
    assert {"!pyproject.toml", "!nvdcp/", "!k8s/image-constraints.txt", "!k8s/wait_for_bucket.py"} <= set(
        ignore
    )


def test_init_containers_run_the_image_script() -> None:
    for form in FORMS:
        for where, pod in training_pods(overlay(form)):
            init = {c["name"]: c for c in pod["initContainers"]}["wait-for-bucket"]
            assert init["command"] == ["python", "/opt/nvdcp/wait_for_bucket.py"], where
            assert init["envFrom"] == trainer(pod)["envFrom"], where
            s3_env = {k: v for k, v in env_of(trainer(pod)).items() if k.startswith("AWS_")}
            assert env_of(init) == s3_env, where


# -- resize -------------------------------------------------------------------------------------------------


def without_size(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The overlay's objects with every replica count and PET_NNODES blanked out."""
    docs_copy = copy.deepcopy(list(docs))
    for doc in docs_copy:
        if doc["kind"] == "PyTorchJob":
            for replica in doc["spec"]["pytorchReplicaSpecs"].values():
                replica["replicas"] = None
        if doc["kind"] == "Job" and doc["metadata"]["name"] == JOB_NAME:
            doc["spec"]["completions"] = doc["spec"]["parallelism"] = None
            main = trainer(doc["spec"]["template"]["spec"])
            env_of(main)["PET_NNODES"]["value"] = None
            main["env"].sort(key=lambda e: e["name"])  # a strategic-merge patch may reorder the list
    return docs_copy


@pytest.mark.parametrize("form", FORMS)
def test_resize_overlay_changes_only_the_size(form: str) -> None:
    before, after = overlay(form), overlay(f"{form}-resize-3")
    (pods_before, nproc), (pods_after, nproc_after) = world_of(before), world_of(after)
    assert (pods_before, pods_after) == (2, 3) and nproc == nproc_after
    assert without_size(before) == without_size(after)  # same image, command, --ckpt-root: a resharded resume


# -- the init step, against a real S3 endpoint --------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def run_wait(endpoint: str, root: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "NVDCP_CKPT_ROOT": root,
        "NVDCP_WAIT_TIMEOUT_S": "2",
    }
    return subprocess.run(
        [sys.executable, str(K8S / "wait_for_bucket.py")], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.s3
def test_wait_for_bucket(s3_endpoint: str) -> None:
    boto3 = pytest.importorskip("boto3")
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket="k8s-ready")
    ready = run_wait(s3_endpoint, "s3://k8s-ready/runs/demo")
    assert ready.returncode == 0 and "is ready" in ready.stdout, ready.stderr
    missing = run_wait(s3_endpoint, "s3://k8s-missing/runs/demo")
    assert missing.returncode == 1 and "404" in missing.stderr
    assert "testing" not in missing.stdout + missing.stderr  # never prints credentials
    local = run_wait(s3_endpoint, "/checkpoints/demo")
    assert local.returncode == 0


def test_install_kubectl_script_parses() -> None:
    script = K8S / "install-kubectl.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
