"""The GPU device check's wiring, without a GPU: the wheels it carries plus what the check machine already
holds cover every requirement of megarl, at the versions constraints.txt pins; its runner refuses to start
without the bundle and names the step that makes it; the stages' budgets fit the check and the check fits one
command on the machine; its dry run passes every stage on the CPU and leaves in its output folder only what
the machine returns; a stage that runs past its budget is ended with every process it started; the two-rank
driver's coalesced all-reduce gives the sums of separate ones.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO, run_python, setup_requirements

pytestmark = pytest.mark.timeout(60)

DEVICE_CHECK = REPO / "tools" / "device_check"
# What the machine takes and returns (the device tool's limits): one command runs at most COMMAND_S; at most
# MAX_FILES files come back from OUT, each at most 16 MiB, none more than 2 folders down.
COMMAND_S = 600
MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
MAX_FOLDERS_DOWN = 2
INSTALL_S = 60  # run.sh before the check: the carried wheels and megarl, without an index
DRY_RUN_TIMEOUT_S = 600  # every stage on this CPU: about 2 minutes on 2 busy cores

# What the check machine's image holds of megarl's requirements (torch 2.11 with CUDA, transformers 5.17 and
# their dependencies, Python 3.12): the rest must travel as wheels.
MACHINE_HAS = {"torch", "transformers", "tokenizers", "safetensors", "pyyaml", "numpy", "psutil", "tqdm"}


def name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def bundle_names() -> list[str]:
    """The distributions tools/device_check/prepare.sh downloads."""
    script = (REPO / "tools" / "device_check" / "prepare.sh").read_text()
    return [name(n) for n in re.search(r"^missing=\((.*)\)$", script, re.M)[1].split()]


def test_carried_wheels_and_the_machine_cover_every_requirement_of_megarl():
    install_requires, _ = setup_requirements()
    needed = {name(r) for r in install_requires}
    bundle = set(bundle_names())
    assert needed - MACHINE_HAS <= bundle, needed - MACHINE_HAS - bundle
    assert not bundle & MACHINE_HAS  # a second copy of the machine's own packages would replace them
    # math-verify's own requirements travel too (sympy is torch's)
    assert {"latex2sympy2-extended", "antlr4-python3-runtime"} <= bundle


def test_every_carried_wheel_is_pinned_in_constraints():
    pinned = {name(line): line for line in (REPO / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    for dist in bundle_names():
        assert dist in pinned and "==" in pinned[dist], dist


def test_runner_without_the_bundle_says_how_to_make_it(tmp_path):
    # A copy of the runner in a checkout-shaped directory without .device_wheels
    (tmp_path / "tools" / "device_check").mkdir(parents=True)
    runner = tmp_path / "tools" / "device_check" / "run.sh"
    runner.write_text((REPO / "tools" / "device_check" / "run.sh").read_text())
    result = subprocess.run(["bash", str(runner), "--dry-run", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "tools/device_check/prepare.sh" in result.stderr


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, DEVICE_CHECK / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_budgets_fit_the_check_and_the_check_fits_one_command():
    check = load_tool("check")
    assert set(check.BUDGET_S) == {stage.__name__ for stage in check.STAGES}
    # what the stages may take leaves time for the check's own work; no stage eats another's budget
    assert check.TOTAL_S - sum(check.BUDGET_S.values()) >= 30, check.BUDGET_S
    # the call the runner's header gives: carries the ignored wheels, and its limit holds the installs and
    # the whole check, within one command of the machine
    header = (DEVICE_CHECK / "run.sh").read_text()
    call = re.search(r'run\(command="bash tools/device_check/run.sh", carry=\[".device_wheels"\], '
                     r"timeout_s=(\d+)\)", header)
    assert call, "run.sh's header gives no device call that carries .device_wheels"
    assert check.TOTAL_S + INSTALL_S <= int(call[1]) <= COMMAND_S


@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 30)
def test_dry_run_passes_every_stage_and_leaves_only_what_the_machine_returns(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    result = run_python([str(DEVICE_CHECK / "check.py"), "--out", str(out), "--dry-run"],
                        env={"TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}, timeout_s=DRY_RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    check = load_tool("check")
    files = [p for p in out.rglob("*") if p.is_file()]
    logs = {f"{stage.__name__}.log" for stage in check.STAGES if stage is not check.preflight}
    assert {p.name for p in files} == {"device_check.json", "device_check.txt"} | logs
    assert len(files) <= MAX_FILES
    assert all(len(p.relative_to(out).parts) - 1 <= MAX_FOLDERS_DOWN for p in out.rglob("*"))
    assert all(p.stat().st_size <= MAX_FILE_BYTES for p in files)
    assert not list(scratch.glob("megarl_device_check_*"))  # models, runs and caches were removed


def test_a_stage_past_its_budget_ends_with_every_process_it_started(tmp_path):
    check = load_tool("check")
    run = check.Check(tmp_path / "out", tmp_path / "work", dry_run=True)
    (tmp_path / "out").mkdir()
    run.stage_deadline = time.monotonic() + 3
    pid_file = tmp_path / "pid"
    # a parent that starts a long child, as torchrun starts its workers
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    assert run.python("stage", ["-c", script]) is None
    assert run.stages["stage"]["status"] == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ended(child) is False:
        time.sleep(0.1)
    assert ended(child), f"the stage's child {child} still runs"


def ended(pid: int) -> bool:
    """True when `pid` is gone or a zombie (ended, not yet reaped by whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return re.search(r"^State:\s+Z", status, re.M) is not None


def _coalesced_worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed import _coalescing_manager

    two_ranks = load_tool("two_ranks")
    calls = []  # tensors per coalesced call: the driver's, not gloo's own host-tensor one, ran

    def counted(group, tensors, opts):
        calls.append(len(tensors))
        return two_ranks.allreduce_coalesced_flat(group, tensors, opts)

    dist.ProcessGroup.allreduce_coalesced = counted
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    group = dist.new_group([0, 1])  # Megatron's data-parallel group, as its gradient sync gets it
    grads = [torch.full((3,), float(rank + 1)), torch.arange(4.0).reshape(2, 2) * (rank + 1)]
    with _coalescing_manager(group, async_ops=True) as cm:
        for g in grads:
            dist.all_reduce(g, group=group, async_op=True)
    cm.wait()
    biggest = torch.tensor([rank, 10 * rank], dtype=torch.int64)
    with _coalescing_manager(group):
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
    torch.save((grads, biggest, calls), f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_two_rank_driver_coalesced_all_reduce_gives_the_separate_sums(tmp_path):
    ctx = mp.start_processes(_coalesced_worker, args=(2, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 45
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 45 s")
    for rank in range(2):
        grads, biggest, calls = torch.load(tmp_path / f"rank{rank}.pt")
        assert calls == [2, 1]
        torch.testing.assert_close(grads[0], torch.full((3,), 3.0), rtol=0, atol=0)
        torch.testing.assert_close(grads[1], torch.arange(4.0).reshape(2, 2) * 3, rtol=0, atol=0)
        assert biggest.tolist() == [1, 10]
