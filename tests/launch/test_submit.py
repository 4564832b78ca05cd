"""Cluster launch: the job command, the staged working dir, the node script, the manifests, and a recipe run
against a real Ray head on loopback (as a Ray job, and as a driver joining the cluster)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.launch._ray_head import ROOT, VENV_BIN, launch_env, ray_head

SHORT_RUN = ["trainer.steps=3", "task.warm_start_steps=20", "logger.run_name=job", "logger.wandb=false"]


def load_submit() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launch_submit", ROOT / "launch" / "submit.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "launch" / "submit.py"), "--dry-run", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=60)


def steps_logged(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_dry_run_builds_a_job_that_joins_the_cluster() -> None:
    env = os.environ | {"FORWARDED": "from-shell"}
    out = dry_run(
        "--address=http://head:8265",
        "--recipe=tiny_moe_r3",
        "--env=A=1",
        "--env=FORWARDED",
        "--venv=/opt/venv",
        "--submission-id=run-7",
        "--",
        "trainer.steps=3",
        "logger.run_root=/shared/runs",
        env=env,
    )
    cmd = shlex.split(out.stdout.splitlines()[0])
    sep = cmd.index("--")
    assert cmd[1:3] == ["job", "submit"] and Path(cmd[0]).name == "ray"
    assert cmd[sep + 1 :] == [
        "/opt/venv/bin/rlfw",
        "train",
        "recipe=tiny_moe_r3",
        "ray_address=auto",
        "trainer.steps=3",
        "logger.run_root=/shared/runs",
    ]
    options = dict(zip(cmd[3:sep:2], cmd[4:sep:2], strict=True))
    assert options["--address"] == "http://head:8265" and options["--submission-id"] == "run-7"
    assert options["--runtime-env"].endswith("runtime_env.json")
    assert "from-shell" not in out.stdout and "A=1" not in out.stdout  # values never printed
    assert "env_vars A, FORWARDED, RAY_OVERRIDE_JOB_RUNTIME_ENV (values not shown)" in out.stdout
    assert "--no-wait" not in cmd  # by default it follows the job and exits 1 if the job failed
    assert "warning" not in out.stderr


def test_env_values_reach_ray_in_a_private_file_not_on_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ps` shows every process's arguments: a W&B key passed with --env must not be among them."""
    submit = load_submit()
    seen: dict[str, object] = {}

    def fake_run(cmd: list[str], check: bool) -> subprocess.CompletedProcess[str]:
        path = Path(cmd[cmd.index("--runtime-env") + 1])
        seen["mode"] = path.stat().st_mode & 0o777
        seen["env"] = json.loads(path.read_text())["env_vars"]
        seen["argv"] = " ".join(cmd)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(submit.subprocess, "run", fake_run)
    monkeypatch.setenv("WANDB_API_KEY", "secret-123")
    assert submit.main(["--env", "WANDB_API_KEY", "--env", "A=1", "--", "logger.run_root=/shared"]) == 0
    assert seen["mode"] == 0o600
    assert seen["env"] == {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", "WANDB_API_KEY": "secret-123", "A": "1"}
    assert "secret-123" not in str(seen["argv"])


def test_relative_run_root_is_warned_about() -> None:
    assert "logger.run_root=/shared/path" in dry_run("--", "trainer.steps=3").stderr
    assert "warning" in dry_run("--", "logger.run_root=runs").stderr


def test_forwarding_an_unset_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLFW_NOT_SET", raising=False)
    with pytest.raises(SystemExit, match="--env RLFW_NOT_SET: not set"):
        load_submit().main(["--dry-run", "--env", "RLFW_NOT_SET"])


def test_staged_working_dir_imports_as_installed(tmp_path: Path) -> None:
    """Ray puts the working dir first on PYTHONPATH: rlfw, rlfw.kernels and the recipes must all resolve
    inside it, not in the checkout the venv may point at."""
    stage = load_submit().stage_working_dir(ROOT, tmp_path / "wd")
    probe = (
        "import rlfw, rlfw.kernels, rlfw.compose as c;"
        "print(rlfw.__file__); print(rlfw.kernels.__file__); print(c.project_root());"
        "print(' '.join(c.available_recipes()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "RLFW_HOME"} | {"PYTHONPATH": str(stage)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the probe's own imports must not add to what staging copied
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    package, kernels, root, recipes = run.stdout.splitlines()
    assert Path(package) == stage / "rlfw" / "__init__.py"
    assert Path(kernels) == stage / "rlfw" / "kernels" / "__init__.py"
    assert Path(root) == stage and "default" in recipes.split()
    files = [p for p in stage.rglob("*") if p.is_file()]
    assert not [p for p in files if "__pycache__" in p.parts or p.suffix == ".pyc"]
    assert {p.relative_to(stage).parts[0] for p in files} == {"rlfw", "configs", "recipes"}
    assert sum(p.stat().st_size for p in files) < 5 * 2**20


@pytest.mark.parametrize(
    "args, slots_env, ray_args, slots",
    [
        (["head", "--block"], None, ["--head", "--port=7000", "--num-gpus=2", "--block"], 2),
        (["worker", "10.0.0.5"], "4", ["--address=10.0.0.5:7000", "--num-gpus=2"], 4),
        (["worker", "10.0.0.5:6400"], None, ["--address=10.0.0.5:6400", "--num-gpus=2"], 2),
    ],
)
def test_ray_cluster_sh_advertises_gpus_as_both_pools(
    tmp_path: Path, args: list[str], slots_env: str | None, ray_args: list[str], slots: int
) -> None:
    """With a stand-in `ray` and an `nvidia-smi` listing two GPUs: each pool gets one slot per GPU unless
    RLFW_POOL_SLOTS says otherwise, and RAY_PORT reaches the workers' head address."""
    fake = {"ray": 'printf "%s\\n" "$@"', "nvidia-smi": "echo 'GPU 0: H100'; echo 'GPU 1: H100'"}
    for name, body in fake.items():
        (tmp_path / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "RAY_PORT": "7000"}
    env.pop("RLFW_POOL_SLOTS", None)
    if slots_env:
        env["RLFW_POOL_SLOTS"] = slots_env
    out = subprocess.run(
        [str(ROOT / "launch" / "ray_cluster.sh"), *args], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    (resources,) = [a for a in out if a.startswith("--resources=")]
    assert json.loads(resources.removeprefix("--resources=")) == {"rollout_gpu": slots, "trainer_gpu": slots}
    assert [a for a in out if a != resources] == ["start", *ray_args]


@pytest.mark.parametrize("script", ["ray_cluster.sh", "slurm.sbatch"])
def test_shell_scripts_parse(script: str) -> None:
    path = ROOT / "launch" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(path)], check=True)


def kuberay_slots(params: dict[str, str]) -> dict[str, int]:
    # KubeRay's format: a YAML string holding a JSON string holding the JSON object.
    return dict(json.loads(json.loads(params["resources"])))


def test_kuberay_manifest_runs_a_recipe_on_the_gpu_workers() -> None:
    job = yaml.safe_load((ROOT / "launch" / "kuberay.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    entry = spec["entrypoint"].split()
    assert entry[:2] == ["rlfw", "train"] and "ray_address=auto" in entry
    recipe = next(a.removeprefix("recipe=") for a in entry if a.startswith("recipe="))
    assert (ROOT / "recipes" / f"{recipe}.yaml").exists()
    assert any(a.startswith("logger.run_root=/shared/") for a in entry)
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"].startswith("2.60")
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert kuberay_slots(head) == {"rollout_gpu": 0, "trainer_gpu": 0} and head["num-gpus"] == "0"
    (workers,) = cluster["workerGroupSpecs"]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert workers["rayStartParams"]["num-gpus"] == gpus
    assert kuberay_slots(workers["rayStartParams"]) == {"rollout_gpu": int(gpus), "trainer_gpu": int(gpus)}
    recipe_yaml = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    wanted = recipe_yaml["engine"]["num_actors"] + recipe_yaml["trainer"]["num_ranks"]
    assert workers["replicas"] * int(gpus) >= wanted
    for group in (cluster["headGroupSpec"], workers):
        env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["DS_ACCELERATOR"] == "cuda"  # rlfw's local default is the CPU accelerator


@pytest.mark.slow
def test_driver_joins_an_existing_cluster(tmp_path: Path) -> None:
    """What a node without the job server does: `rlfw train ray_address=HEAD:PORT` places both pools on a
    head that `ray start` brought up, instead of starting a local Ray."""
    with ray_head(dashboard=False) as head:
        cmd = [str(VENV_BIN / "rlfw"), "train", f"ray_address={head.gcs_address}", *SHORT_RUN]
        cmd.append(f"logger.run_root={tmp_path}")
        run = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=240, check=False)
        assert run.returncode == 0, run.stderr[-4000:]
        assert f"Connecting to existing Ray cluster at address: {head.gcs_address}" in run.stderr
    assert steps_logged(tmp_path / "job") == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("aiohttp") is None,
    reason="the Ray job server needs ray[default] (aiohttp, ...); `pip install -e .[dev]` brings it",
)
def test_recipe_runs_as_a_ray_job() -> None:
    """launch/submit.py against a head with its job server: the job's driver joins that cluster
    (ray_address=auto), runs from the staged working dir, and the run folder lands where we asked."""
    with ray_head(dashboard=True) as head:
        # Under the head's temp dir, so the driver's command line names it and stopping the head sweeps it.
        run_root = head.temp_dir / "runs"
        job_id = f"rlfw-test-{os.getpid()}"
        submit = [sys.executable, str(ROOT / "launch" / "submit.py"), f"--address={head.job_server}"]
        submit += [f"--submission-id={job_id}", "--env=OMP_NUM_THREADS", "--env=DS_ACCELERATOR=cpu"]
        submit += ["--env=TORCH_EXTENSIONS_DIR", "--env=WANDB_MODE", "--", *SHORT_RUN]
        submit.append(f"logger.run_root={run_root}")
        env = launch_env()
        run = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=240, check=False)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        assert "ray_address=auto" in run.stdout and "_ray_pkg_" in run.stdout + run.stderr
        from ray.job_submission import JobStatus, JobSubmissionClient

        assert JobSubmissionClient(head.job_server).get_job_status(job_id) == JobStatus.SUCCEEDED
        assert steps_logged(run_root / "job") == [0, 1, 2]
