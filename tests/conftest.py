"""Shared fixtures: tiny checkpoints and arithmetic data made once per session, and one process-wide
Megatron parallel state for the tests that build a TrainEngine in this process.

Megatron's `parallel_state` is process-global and `init_parallel` makes a one-process gloo group, so every
in-process engine test shares the `groups` fixture; anything that needs its own process state (the CLI, a
fresh interpreter) runs in a subprocess with a timeout.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One thread per process, in this process and every child (torchrun gives its ranks one already): a CPU's
# sums then round the same however many cores the machine has, so a learning test sees one trajectory on a
# given CPU, and two processes of a test never oversubscribe the cores.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402  (after the thread count, which torch reads at import)

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
# GPU-only tests carry both marks: `pytest -m gpu` selects them, and they skip themselves without a device.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only test: needs a CUDA device")
SUBPROCESS_TIMEOUT_S = 120  # every subprocess call of the suite is bounded; a hang fails instead of stalling

# Without Transformer Engine/apex (every CPU run) megatron warns at import about the fallbacks it uses.
_EXPECTED_WARNINGS = (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    ".*is deprecated. Please use `torch.distributed.*",
    ".*full scope is deprecated.*",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one (tools/gpu_check.sh and "
                                       "tools/device_check/run.sh run them)")
    for pattern in _EXPECTED_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{pattern}")
    config.addinivalue_line("markers", "alone: reads the host's free memory: holds no shared host lock, and takes "
                                       "the host to itself where it measures (host_to_itself)")
    config.addinivalue_line("markers", "learning: trains for minutes to show that a recipe raises its "
                                       "objective (run once per CI, in the first environment)")
    if config.option.durations is None:  # the 20 slowest tests close every run: the suite has a time budget
        config.option.durations = 20
    # pytest-xdist hands out test files in collection order (below: longest first) instead of by test count
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Seconds each long test file takes (its tests and the fixtures they make), measured in one run of the README
# command on a busy 2-core machine (pytest --junitxml; the quickstart fixture counts where it was made). Under
# `--dist loadfile` the two processes take files longest first, so neither is left with a long file at the
# end while the other idles; the files not listed (each under 20 s) follow in their usual order. A file
# that grows long belongs here.
FILE_SECONDS = {
    "test_sglang.py": 600, "test_sglang_runs.py": 600,  # the SGLang environment's command (README)
    "test_split.py": 415, "test_rl_recipes.py": 402, "test_engine_faults.py": 330, "test_tool_recipe.py": 303,
    "test_convert.py": 182, "test_resume.py": 151, "test_router_replay.py": 136, "test_parallel.py": 150,
    "test_placement.py": 117, "test_cli.py": 112, "test_device_check.py": 105, "test_sft.py": 69, "test_choreography.py": 55,
    "test_stop.py": 55, "test_distill.py": 160, "test_rlhf.py": 100, "test_process_groups.py": 48, "test_dpo.py": 47,
    "test_rm.py": 42, "test_handover.py": 29, "test_sandbox_attacks.py": 130, "test_packing.py": 27,
    "test_convert_memory.py": 27, "test_shared_prompts.py": 25, "test_trackers.py": 22, "test_rewards_scorer.py": 22,
    "test_extending.py": 35, "test_fault_matrix.py": 200, "test_architectures.py": 45,
    "test_architectures_gpt_oss.py": 45, "test_architectures_gemma3.py": 35, "test_optimizer_offload.py": 50,
    "test_architectures_vlm.py": 10, "test_data_images.py": 15,
}


def pytest_collection_modifyitems(config, items):
    """Files longest first (FILE_SECONDS; a stable sort keeps each file's tests in order). A test that asks for
    `quickstart_out` may make it, or wait for another process making it, within the time pytest-timeout gives
    the test: a limit below the quickstart's own gets the quickstart's added."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
    for item in items:
        marker = item.get_closest_marker("timeout")
        if "quickstart_out" in item.fixturenames and marker and marker.args and marker.args[0] < QUICKSTART_TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(QUICKSTART_TIMEOUT_S + marker.args[0]), append=False)


# Under pytest-xdist the test processes share the host: a test that reads the memory free on it (as SGLang's CPU
# mode sizes its pool) sees another process's test starting or ending an engine move that reading by gigabytes.
# Each test, with the fixtures its setup makes and its teardown ends, holds a shared lock. A test marked `alone`
# holds none; where it measures, it (or its child process: HOST_LOCKS_ENV names the folder) takes the host to
# itself: it closes a gate that tests about to start wait at, takes the lock exclusively once the tests under
# way elsewhere have ended, and waits for the host's free memory to settle. Two flock(2) files beside the
# processes' temporary directories; nothing is held without xdist.
HOST_LOCKS_ENV = "MEGARL_TEST_HOST_LOCKS"
SETTLE_BYTES = 64 * 2**20  # free memory that moves less than this over three readings half a second apart has settled
SETTLE_WAIT_S = 30


def _host_memory_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


@contextlib.contextmanager
def host_to_itself(lock_dir: Path | None, alone: bool):
    """Shared around every test under xdist; exclusive (after the gate) for what an `alone` test measures.
    `lock_dir` None (no other test process): nothing to take."""
    if lock_dir is None:
        yield
        return
    with open(lock_dir / "host.gate", "a") as gate, open(lock_dir / "host.lock", "a") as lock:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX)
            readings, deadline = [], time.monotonic() + SETTLE_WAIT_S
            while time.monotonic() < deadline:  # processes of the test that just ended may still be exiting
                readings = readings[-2:] + [_host_memory_available()]
                if len(readings) == 3 and max(readings) - min(readings) < SETTLE_BYTES:
                    break
                time.sleep(0.5)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(lock, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def host_lock_dir(config) -> Path | None:
    """The folder of the host locks the test processes of this run share (None without xdist)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return config._tmp_path_factory.getbasetemp().parent  # shared by the workers of one run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    alone = item.get_closest_marker("alone") is not None
    with host_to_itself(None if alone else host_lock_dir(item.config), alone=False):
        yield


@pytest.fixture
def host_locks_env(request) -> dict[str, str]:
    """For an `alone` test's child process: the environment that names the host locks (HOST_LOCKS_ENV; empty
    without xdist), which it takes around its measurement with `host_to_itself(..., alone=True)`."""
    lock_dir = host_lock_dir(request.config)
    return {HOST_LOCKS_ENV: str(lock_dir) if lock_dir else ""}


def setup_requirements() -> tuple[list[str], dict[str, list[str]]]:
    """install_requires and extras_require of setup.py, read from its source (both are literals)."""
    call = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    kwargs = {kw.arg: kw.value for kw in call.keywords}
    return ast.literal_eval(kwargs["install_requires"]), ast.literal_eval(kwargs["extras_require"])


def subprocess_env() -> dict[str, str]:
    """The environment for child processes: this checkout first on the path, never the model hub."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a child must start its own one-process group, not join ours
    return env


def run_python(args: list[str], *, cwd: Path | str | None = None, timeout_s: float = SUBPROCESS_TIMEOUT_S,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh interpreter (with `env` added to its environment), output captured, bounded
    by `timeout_s`."""
    return subprocess.run([sys.executable, *args], cwd=cwd or REPO, env=subprocess_env() | (env or {}),
                          capture_output=True, text=True, timeout=timeout_s)


def in_gpu_world(nproc: int) -> list[str]:
    """`python` arguments that run `megarl ARGS` (append them) on `nproc` torchrun ranks in the world megarl starts
    on a GPU, emulated on the CPU: its NCCL part refuses host tensors as NCCL does (tests/gpu_world_worker.py)."""
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "gpu_world_worker.py"), "megarl"]


def _tiny_model_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "tools" / "make_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def isolated() -> str:
    """The code sandbox's isolation mode here (megarl.rewards.sandbox): a test that runs generated code asks for
    it. Without isolation such a test is skipped, except under CI=true, where it fails (docs/testing.md)."""
    from megarl.rewards.sandbox import SandboxUnavailable, sandbox_mode

    try:
        return sandbox_mode()
    except SandboxUnavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the sandbox isolated: {e}")
        pytest.skip(f"the sandbox cannot isolate code here: {e}")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_models) -> Path:
    """Tiny Qwen2 (hidden 64, 2 layers, GQA 4/2, random qkv bias, tied embeddings), seed 0."""
    return _tiny_model_tool().make_tiny_model(tiny_models / "qwen2_seed0", arch="qwen2", seed=0)


@pytest.fixture(scope="session")
def qwen2_other_dir(tiny_models) -> Path:
    """Same architecture as `qwen2_dir`, different weights (seed 1): the target of weight-push tests."""
    return _tiny_model_tool().make_tiny_model(tiny_models / "qwen2_seed1", arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    """Tiny Llama (no bias, untied output layer), seed 0."""
    return _tiny_model_tool().make_tiny_model(tiny_models / "llama_seed0", arch="llama", seed=0)


@pytest.fixture(scope="session")
def arch_dir(tiny_models):
    """`arch_dir("mixtral")`: the tiny checkpoint of that architecture (tools/make_tiny_model.py defaults:
    hidden 64, 2 layers, GQA 4/2; MoE: 4 experts, top-2), seed 0, made on first use."""
    def make(arch: str) -> Path:
        out = tiny_models / f"{arch}_seed0"
        if not (out / "megarl_tiny.json").exists():
            _tiny_model_tool().make_tiny_model(out, arch=arch, seed=0)
        return out
    return make


@pytest.fixture(scope="session")
def arithmetic_dir(tmp_path_factory) -> Path:
    """train.jsonl and heldout.jsonl written by `python -m megarl.data.arithmetic`."""
    out = tmp_path_factory.mktemp("arithmetic")
    result = run_python(["-m", "megarl.data.arithmetic", "--out", str(out)], timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert (out / "train.jsonl").is_file() and (out / "heldout.jsonl").is_file()
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Arithmetic rows for SFT (train.jsonl, heldout.jsonl: prompt/answer) and preference pairs for DPO
    (train_pairs.jsonl, heldout_pairs.jsonl), 4000 train and 128 held-out problems."""
    from megarl.data.arithmetic import make_arithmetic_splits, write_preference_pairs

    out = tmp_path_factory.mktemp("tiny_data")
    for split in make_arithmetic_splits(out, seed=0, train_size=4000, heldout_size=128):
        write_preference_pairs(split, split.with_name(f"{split.stem}_pairs.jsonl"), seed=0)
    return out


@pytest.fixture(scope="session")
def groups():
    """Megatron's parallel state for this process: one rank, TP=1, PP=1 (gloo on CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.engine.parallel import init_parallel

    yield init_parallel(tp=1, pp=1, seed=0)
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


QUICKSTART_TIMEOUT_S = 900  # ~2.5 min on 2 cores (docs/quickstart.md: 1-3 minutes on a quiet one)


def quickstart(out: Path, *args: str, timeout_s: float = QUICKSTART_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`bash tools/quickstart.sh --out OUT ARGS` with this environment's `megarl` first on the PATH."""
    env = subprocess_env()
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    return subprocess.run(["bash", str(REPO / "tools" / "quickstart.sh"), "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="session")
def quickstart_out(tmp_path_factory) -> Path:
    """OUT of one full quickstart run: OUT/model, OUT/data, and OUT/run with its warm start and metrics. Made
    once per pytest run: the first process of the run (pytest-xdist) that needs it makes it in the run's shared
    temporary directory, the others wait for it and read it. Tests only read it (those that train on copy it)."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the directory every worker's own is in
    out = shared / "quickstart"
    with FileLock(f"{out}.lock"):
        if not (out / "made").is_file():
            shutil.rmtree(out, ignore_errors=True)  # a run that failed midway
            out.mkdir()
            proc = quickstart(out, "log.progress=false")
            assert proc.returncode == 0, proc.stderr[-4000:]
            (out / "made").touch()
    return out


def from_warm_start(quickstart_out: Path, run_dir: Path, *, steps: int) -> list[str]:
    """`megarl train` arguments: the quickstart recipe's GRPO for `steps` steps from the warm start, model and
    data of `quickstart_out`, into `run_dir` (the held-out reward at the last step only, no final export)."""
    return [str(REPO / "recipes" / "quickstart.yaml"), f"run_dir={run_dir}",
            f"model.path={quickstart_out / 'run' / 'warmup'}", "warmup.sft_steps=0",
            f"data.train_path={quickstart_out / 'data' / 'train.jsonl'}",
            f"data.eval_path={quickstart_out / 'data' / 'heldout.jsonl'}", f"data.eval_every={steps}",
            f"train.steps={steps}", "checkpoint.save_final=false", "log.progress=false"]


def reward_first_last(metrics: list[dict]) -> tuple[float, float]:
    """The mean `reward/mean` of the first 10 and of the last 10 steps."""
    rewards = [m["reward/mean"] for m in metrics]
    return sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10


def with_score_head(model_dir, out_dir, *, seed: int = 3):
    """A copy of `model_dir` as a one-label sequence-classification checkpoint (a reward model's layout):
    the trunk's weights plus a random `score.weight` [1, hidden]."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    tensors["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    config["num_labels"] = 1
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
