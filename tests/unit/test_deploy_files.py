"""The deployment recipes in deploy/ parse, hang together, and install through the script CI runs.

No container engine, Slurm or Kubernetes runs here: these checks read the files (YAML, the
Dockerfile and Apptainer instruction sets, shell syntax) and check what the recipes promise
each other (paths, names, sizes, ports), and that hora's identity detection gives every pod of
the Kubernetes manifest its rank. tests/integration/test_deploy.py runs the Slurm script and the
manifest's environment with real processes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hora.identity import detect

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTALL = "bash scripts/install.sh"
IMAGE_ROOT = "/opt/hora"  # where every image holds the repository

DOCKERFILE_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}  # fmt: skip
APPTAINER_SECTIONS = {
    "arguments", "setup", "files", "environment", "post", "runscript", "startscript", "test",
    "labels", "help",
}  # fmt: skip


# -- the install script CI runs ---------------------------------------------------------------
def test_ci_installs_through_scripts_install_sh() -> None:
    """.ci/run -> scripts/test.sh -> scripts/install.sh: the script the recipes run."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec bash scripts/test\.sh", ci, re.M), ci
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r"^(\S+=\S+ )?bash scripts/install\.sh --all$", test_sh, re.M), test_sh


@pytest.mark.parametrize("script", ["scripts/install.sh", "deploy/slurm.sbatch",
                                    "deploy/ssh-node.sh"])  # fmt: skip
def test_shell_scripts_parse(script: str) -> None:
    shell = "sh" if script.endswith("ssh-node.sh") else "bash"
    done = subprocess.run([shell, "-n", str(ROOT / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# -- Dockerfiles ----------------------------------------------------------------------------
def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper() if word.isupper() else word, rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


@pytest.mark.parametrize(("name", "base"), [("Dockerfile.cpu", "python:3"),
                                            ("Dockerfile.cuda", "nvidia/cuda:")])  # fmt: skip
def test_dockerfiles_are_sane_and_run_the_install_script(name: str, base: str) -> None:
    steps = dockerfile(DEPLOY / name)
    unknown = [w for w, _ in steps if w not in DOCKERFILE_INSTRUCTIONS]
    assert not unknown, f"{name}: not Dockerfile instructions: {unknown}"
    words = [w for w, _ in steps]
    assert words[0] in ("ARG", "FROM") and words.count("FROM") == 1, words
    first = words.index("FROM")
    before = dict(a.split("=", 1) for w, a in steps[:first] if w == "ARG")
    image = re.sub(r"\$\{(\w+)\}", lambda m: before[m.group(1)], steps[first][1])
    assert image.startswith(base) and ":" in image, image
    if "cuda" in name:
        assert "runtime" in image, image
    # what RUN and ENV use after FROM is declared after FROM (an ARG before it is not visible)
    declared: set[str] = set()
    for word, args in steps[first + 1 :]:
        if word == "ARG":
            declared.add(args.split("=", 1)[0])
        elif word == "ENV":
            used = set(re.findall(r"\$\{?(\w+)", args)) - declared - {"PATH"}
            assert not used, f"{name}: ENV uses undeclared {used}"
            declared.update(re.findall(r"(\w+)=", args))
        elif word == "RUN":
            used = set(re.findall(r"\$\{(\w+)\}", args)) - declared
            assert not used, f"{name}: RUN uses undeclared {used}"
    assert ("COPY", f". {IMAGE_ROOT}") in steps and ("WORKDIR", IMAGE_ROOT) in steps
    runs = [a for w, a in steps if w == "RUN"]
    assert any(INSTALL in r for r in runs), f"{name} does not run {INSTALL}"
    install = next(r for r in runs if INSTALL in r)
    assert 'HORA_TORCH_INDEX_URL="${TORCH_INDEX_URL}"' in install
    env = " ".join(a for w, a in steps if w == "ENV")
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in env  # mpirun as the image's root user
    assert ("EXPOSE", "22") in steps  # sshd, for hora run -H between containers
    json.loads(dict(steps)["CMD"])  # the exec form


def test_dockerfile_parser_catches_broken_files(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM x\nRUN a \\\n")
    with pytest.raises(AssertionError, match="continued line"):
        dockerfile(bad)
    bad.write_text("FORM x\n")
    assert dockerfile(bad) == [("FORM", "x")]  # and FORM is not in the instruction set


def test_the_cpu_image_takes_cpu_wheels_and_the_cuda_image_the_default_ones() -> None:
    def args(name: str) -> list[str]:
        return [a for w, a in dockerfile(DEPLOY / name) if w == "ARG"]

    cpu = args("Dockerfile.cpu")
    assert any(a.startswith("TORCH_INDEX_URL=") and a.endswith("/cpu") for a in cpu), cpu
    assert "TORCH_INDEX_URL=" in args("Dockerfile.cuda")  # empty: the default, CUDA and NCCL
    assert "HORA_TORCH_INDEX_URL" in (ROOT / "scripts" / "install.sh").read_text()


# -- compose ----------------------------------------------------------------------------------
def _compose(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


def _dockerfile_of(service: dict[str, Any]) -> Path:
    build = service["build"]
    return (DEPLOY / build["context"] / build["dockerfile"]).resolve()


def test_compose_starts_a_two_container_job_over_ssh() -> None:
    data = _compose("compose.yaml")
    services = data["services"]
    assert set(services) == {"keys", "worker", "launcher"}
    for name, svc in services.items():
        assert _dockerfile_of(svc) == DEPLOY / "Dockerfile.cpu", name
        for other in svc.get("depends_on", {}):
            assert other in services, (name, other)
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in data["volumes"], vol
    command = services["launcher"]["command"]
    assert command[:2] == ["sh", f"{IMAGE_ROOT}/deploy/ssh-node.sh"]
    assert services["worker"]["command"] == command[:2]  # sshd in the foreground
    run = command[2:]
    assert run[:2] == ["hora", "run"]
    hosts = dict(h.split(":") for h in run[run.index("-H") + 1].split(","))
    assert set(hosts) == {"launcher", "worker"}  # the containers' host names
    assert {services[h]["hostname"] for h in hosts} == set(hosts)
    assert int(run[run.index("-np") + 1]) == sum(int(n) for n in hosts.values())
    script = run[run.index("python") + 1]
    assert (ROOT / script).is_file(), script  # relative to working_dir, the repository
    assert services["launcher"]["working_dir"] == IMAGE_ROOT
    assert services["launcher"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert "ssh-keygen" in " ".join(services["keys"]["command"])


def test_compose_gpu_override_asks_for_every_gpu_with_the_cuda_image() -> None:
    base = _compose("compose.yaml")["services"]
    gpu = _compose("compose.gpu.yaml")["services"]
    assert set(gpu) <= set(base)
    for name in ("worker", "launcher"):
        assert _dockerfile_of(gpu[name]) == DEPLOY / "Dockerfile.cuda"
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert len({gpu[n]["image"] for n in gpu}) == 1  # the key maker builds the same image


# -- Apptainer ----------------------------------------------------------------------------------
def apptainer(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(header, sections) of a definition file."""
    header: dict[str, str] = {}
    sections: dict[str, str] = {}
    current = None
    for line in path.read_text().splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            assert current in APPTAINER_SECTIONS, f"unknown section %{current}"
            assert current not in sections, f"%{current} twice"
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            key, sep, value = line.partition(":")
            assert sep, f"header line without a colon: {line!r}"
            header[key.strip()] = value.strip()
    return header, sections


def test_apptainer_definition_installs_through_the_install_script() -> None:
    header, sections = apptainer(DEPLOY / "hora.def")
    assert header["Bootstrap"] == "docker" and header["From"].startswith("python:3")
    assert (DEPLOY / "hora.def").read_text().startswith("Bootstrap:")
    assert sections["files"].split() == [".", IMAGE_ROOT]
    post = sections["post"]
    assert f"cd {IMAGE_ROOT}" in post and INSTALL in post
    lines = sections["arguments"].splitlines()
    declared = {ln.split("=", 1)[0].strip() for ln in lines if "=" in ln}
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", (DEPLOY / "hora.def").read_text()))
    assert used and used <= declared, (used, declared)
    assert "hora" in sections["runscript"]


# -- Slurm ----------------------------------------------------------------------------------
def test_slurm_script_asks_before_it_runs_and_starts_ranks_with_srun() -> None:
    lines = (DEPLOY / "slurm.sbatch").read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    directives = [ln for ln in lines if ln.startswith("#SBATCH")]
    # sbatch reads directives only before the first command
    assert all(lines.index(d) < first_command for d in directives), directives
    options = dict(d.split()[1].lstrip("-").split("=", 1) for d in directives)
    assert int(options["nodes"]) >= 2 and int(options["ntasks-per-node"]) >= 1
    srun = [ln for ln in lines if re.match(r"\s*exec srun ", ln)]
    assert len(srun) == 1 and "--kill-on-bad-exit=1" in srun[0]


# -- Kubernetes -------------------------------------------------------------------------------
def _manifest() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def _pod_env(job: dict[str, Any]) -> dict[str, str]:
    """The literal variables of the container (secrets left out)."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_kubernetes_manifest_is_an_indexed_job_with_a_headless_service() -> None:
    kinds = _manifest()
    assert set(kinds) == {"Service", "Job"}
    svc, job = kinds["Service"], kinds["Job"]
    assert svc["apiVersion"] == "v1" and job["apiVersion"] == "batch/v1"
    assert svc["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["restartPolicy"] == "Never"
    env = _pod_env(job)
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"])
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert int(env["MASTER_PORT"]) in [p["port"] for p in svc["spec"]["ports"]]
    container = pod["spec"]["containers"][0]
    secret = next(e for e in container["env"] if e["name"] == "HORA_SECRET_KEY")
    assert "secretKeyRef" in secret["valueFrom"]
    assert container["workingDir"] == IMAGE_ROOT
    script = container["command"][container["command"].index("python") + 1]
    assert (ROOT / script).is_file(), script
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts


def test_every_pod_of_the_manifest_finds_its_rank() -> None:
    """What each pod sees: the manifest's variables, the secret, and the index Kubernetes sets."""
    job = _manifest()["Job"]
    env = {**_pod_env(job), "HORA_SECRET_KEY": "ab"}
    n = job["spec"]["completions"]
    idents = [detect({**env, "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"hora-{i}"})
              for i in range(n)]  # fmt: skip
    assert [(d.source, d.rank, d.size) for d in idents] == [("kubernetes", i, n) for i in range(n)]
    assert [d.host_store for d in idents] == [True] + [False] * (n - 1)
    assert {(d.rendezvous_addr, d.rendezvous_port) for d in idents} == {
        (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    }


def test_docs_say_what_was_run_here() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for name in ("Dockerfile.cpu", "Dockerfile.cuda", "compose.yaml", "compose.gpu.yaml",
                 "hora.def", "slurm.sbatch", "kubernetes.yaml", "--gpus all", "--nv",
                 "nvidia.com/gpu"):  # fmt: skip
        assert name in text, name
    assert "## What was run" in text


def _compose_cli() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _compose_cli(), reason="no docker compose here")
def test_compose_config_is_valid_for_docker_compose() -> None:
    for files in (["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]):
        argv = ["docker", "compose", *(f for n in files for f in ("-f", f"deploy/{n}")), "config",
                "-q"]  # fmt: skip
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
