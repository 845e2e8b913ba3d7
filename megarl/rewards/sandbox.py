"""Run untrusted Python (the `code` reward's harness, the `python` tool) isolated by bubblewrap, failing closed.
docs/rewards.md, "Code sandbox", says what it promises in each mode; here is where each promise is kept.

- `bwrap` (bubblewrap, a small setuid-free tool the kernel namespaces are driven by) unshares every namespace
  (user, mount, PID, network, IPC, UTS, cgroup), forbids further user namespaces, drops every capability and
  builds the run's filesystem: read-only /usr (/bin, /lib* as on the host) and interpreter prefix, a fresh
  /proc with /proc/sys read-only and the host's figures (HOST_WIDE_PROC) reading empty, a /dev of five
  nodes (_devices), and /sandbox, a tmpfs of `disk_mb`. No /tmp, /run, /home, host socket or network.
- megarl.rewards.sandbox_kernel holds the rest of what the kernel enforces: the seccomp filter (system calls
  that escape, hold memory outside the address space, or carry bits between runs), the run's cgroup
  ("cgroup" mode: memory_mb and max_processes bound the whole run), and the run's host uid (run_user: its
  own for a root trainer; for any other trainer its own uid, one run at a time unless `share_uid`).
- _BOOT, the run's first process (PID 1 of its PID namespace), sets the per-process limits (RLIMIT_AS,
  CPU, NOFILE, NPROC; no real-time priority, negative nice or locked memory), turns huge pages off, raises
  its oom_score_adj and makes itself non-dumpable, so no process of the run can change it. After every run
  this process kills it through a pidfd (the kernel then kills every process of the run), lets bwrap reap
  it and reaps bwrap (_end_run): nothing outlives a run, and no zombie is left.
- "rlimit" mode (no usable cgroup): memory_mb bounds each process's address space; the run holds at most
  `sandbox_memory_bound_mb`. stdout and stderr are pipes read here, output_bytes each at most.

Failing closed: `check_sandbox` (called when a recipe's code reward or python tool is built, i.e. at launch)
raises SandboxUnavailable saying why and what to install or configure when no mode works: a probe run checks
the isolation above from inside, and every run checks from outside that it is not host root. Two opt-outs:
`insecure: true` runs the code as a plain child process with rlimits only (local debugging; logged as a
warning), and `service_url` sends each run to an external sandbox service (`run_on_service`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.config import SandboxConfig
from megarl.rewards.sandbox_kernel import (RUN_UIDS, RunCgroup, SandboxUnavailable, cgroup_parents, run_cgroup,
                                           run_user, seccomp_program)

log = logging.getLogger(__name__)

WORKDIR = "/sandbox"  # the run's tmpfs, its working directory, inside the sandbox
NOBODY = 65534  # the run's uid inside its user namespace (the host uid it maps to is run_user's)
OPEN_FILES = 64  # RLIMIT_NOFILE of each process of a run: bounds its sockets, pipes and their kernel buffers
# Runs first in the sandbox as `python -I -c _BOOT CPU_S MEMORY_BYTES MAX_PROCESSES OPEN_FILES`, as the
# run's first process (PID 1 of its PID namespace): sets the per-process limits (inherited by everything the
# program starts, and no process of the run may raise them), makes itself non-dumpable, so that no process
# of the run can open its /proc/1/mem or change it in any way, then runs program.py in a child and reaps
# every process left to it until that child exits, with the child's status (128 + N for signal N). When it
# exits, the kernel kills what is left of the run. Nothing here is a protection the program could undo.
_BOOT = r"""
import ctypes, os, resource, sys
cpu_s, memory_bytes, max_processes, open_files = map(int, sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
if max_processes:  # 0: no limit (insecure mode, where it would count every process of the user)
    resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# nothing of the trainer's scheduling or locked memory carries over: no real-time priority, no nice below 0,
# no locked pages, few queued signals, no POSIX message queue bytes
for limit, value in ((resource.RLIMIT_RTPRIO, 0), (resource.RLIMIT_NICE, 0), (resource.RLIMIT_MEMLOCK, 0),
                     (resource.RLIMIT_SIGPENDING, 256), (resource.RLIMIT_MSGQUEUE, 0)):
    resource.setrlimit(limit, (value, value))
if os.sched_getscheduler(0) not in (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_IDLE):
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
if os.getpriority(os.PRIO_PROCESS, 0) < 0:
    os.setpriority(os.PRIO_PROCESS, 0, 0)
with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer takes the run first, never the trainer
    f.write("1000")
prctl = ctypes.CDLL(None, use_errno=True).prctl
if prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE: no huge pages, which a pipe could pin 2 MiB at a time
    sys.exit("cannot turn huge pages off for the run")
if prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("cannot make the run's first process non-dumpable")
program = os.fork()
if program == 0:
    prctl(4, 1, 0, 0, 0)  # the program itself is an ordinary process again
    sys.argv = ["program.py"]
    sys.dont_write_bytecode = True
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.exit()
while True:
    pid, status = os.waitpid(-1, 0)
    if pid == program:
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
"""


class SandboxServiceError(RuntimeError):
    """The external sandbox service did not answer a run with a valid result."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # exit status, 128 + N when signal N ended the program; None = wall-clock kill
    stdout: str  # at most output_bytes of it
    stderr: str  # at most output_bytes of it
    mode: str  # cgroup | rlimit | insecure | service (see the module docstring)

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def run_python(code: str, limits: SandboxConfig, *, stdin: str = "") -> SandboxResult:
    """Run `code` as a Python program fed `stdin`, under `limits`, in the sandbox (or on the service, or
    without isolation when `limits.insecure`); nothing it started is left running when this returns."""
    if limits.service_url is not None:
        return run_on_service(code, limits, stdin=stdin)
    if limits.insecure:
        _warn_insecure()
        return _run_insecure(code, limits, stdin=stdin)
    return _run_isolated(code, limits, stdin=stdin, mode=sandbox_mode())


def check_sandbox(limits: SandboxConfig) -> str:
    """The mode runs under `limits` will use; SandboxUnavailable when code could not run isolated here."""
    if limits.service_url is not None:
        return "service"
    if limits.insecure:
        _warn_insecure()
        return "insecure"
    return sandbox_mode()


def sandbox_memory_bound_mb(limits: SandboxConfig) -> int:
    """The most memory, in MiB, one run under `limits` can hold in this machine's mode, whatever it does.

    cgroup: memory_mb, the cgroup's limit, charged with the run's pages, its tmpfs and the kernel's objects
    for it (socket buffers included; cgroup v1 counts those apart, up to another memory_mb). rlimit:
    max_processes x (memory_mb of address space + OPEN_FILES socket buffers of the host's default size,
    net.core.wmem_default + rmem_default, which the run cannot raise) + disk_mb. What RLIMIT_AS would miss
    otherwise (memfd, SysV and POSIX IPC, TCP, larger socket and pipe buffers) is refused in both modes."""
    if sandbox_mode() == "cgroup":
        return limits.memory_mb * (2 if len(cgroup_parents()) == 2 else 1)
    socket_bytes = sum(int(Path(f"/proc/sys/net/core/{name}").read_text()) for name in ("wmem_default", "rmem_default"))
    return limits.max_processes * (limits.memory_mb + -(-OPEN_FILES * socket_bytes // 2**20)) + limits.disk_mb


@functools.cache
def sandbox_mode() -> str:
    """ "cgroup" or "rlimit": the first mode whose probe run shows the isolation in place (probed once per
    process); SandboxUnavailable naming what failed in each and what to install or configure."""
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("the code sandbox needs bubblewrap: `bwrap` is not on PATH "
                                 "(Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap)")
    try:
        seccomp_program()
    except (ImportError, OSError) as e:
        raise SandboxUnavailable(f"the code sandbox needs libseccomp and pyseccomp ({type(e).__name__}: {e}): "
                                 "apt-get install libseccomp2; pip install pyseccomp") from None
    failures = []
    for mode in ("cgroup", "rlimit"):
        why = _probe(mode)
        if why is None:
            return mode
        failures.append(f"{mode} mode: {why}")
    raise SandboxUnavailable(
        "the code sandbox cannot isolate code on this machine (" + "; ".join(failures) + "). bubblewrap needs "
        "unprivileged user namespaces (sysctl user.max_user_namespaces > 0, and kernel.unprivileged_userns_clone=1 "
        "where that exists); in Docker, whose default seccomp profile refuses them, run the container with a "
        "seccomp profile that allows unshare/clone of user namespaces. Otherwise set sandbox.service_url to an "
        "external sandbox service, or (local debugging only) sandbox.insecure: true")


# Checked inside the probe run: the process has no capability, runs under a seccomp filter, sees only the
# few processes of a fresh PID namespace and no network interface but its loopback, can write no kernel
# setting (/proc/sys), change no host device node, and cannot open the run's first process's memory.
# (That it is not host root is checked from outside, at every run: _check_not_host_root.)
_PROBE = r"""
import os
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
pids = [name for name in os.listdir("/proc") if name.isdigit()]
failed = []
if int(status["CapEff"], 16) != 0 or int(status["CapBnd"], 16) != 0:
    failed.append(f"capabilities {status['CapEff'].strip()}")
if status["Seccomp"].strip() != "2":
    failed.append("no seccomp filter")
if interfaces != ["lo"]:
    failed.append(f"network interfaces {interfaces}")
if len(pids) > 3:
    failed.append(f"processes of the host visible: {len(pids)}")
for what, attempt in (("/proc/sys writable", lambda: os.close(os.open("/proc/sys/kernel/core_pattern", os.O_WRONLY))),
                      ("host device nodes can be chmod-ed", lambda: os.chmod("/dev/null", 0o666)),
                      ("the first process's memory can be opened", lambda: open("/proc/1/mem", "rb").close())):
    try:
        attempt()
        failed.append(what)
    except OSError:
        pass
print("not isolated: " + ", ".join(failed) if failed else "isolated")
"""


def _probe(mode: str) -> str | None:
    """Why a probe run in `mode` fails, or None when it ran and found the isolation in place."""
    limits = SandboxConfig(cpu_s=5, wall_s=30.0, memory_mb=256)
    if mode == "cgroup" and cgroup_parents() is None:
        return "no writable cgroup (v2 with memory and pids delegated, or v1 memory and pids) for this process"
    try:
        result = _run_isolated(_PROBE, limits, stdin="", mode=mode)
    except (OSError, SandboxUnavailable) as e:
        return f"{type(e).__name__}: {e}"
    if result.stdout.startswith("not isolated"):
        return result.stdout.strip()
    if result.returncode != 0 or result.stdout != "isolated\n":
        as_root = (f" (as root, megarl runs bwrap as a uid of no account, {RUN_UIDS}, which must be able to read "
                   f"{_interpreter()[1]})") if os.getuid() == 0 else ""
        return f"the probe run failed (exit status {result.returncode}){as_root}: {result.stderr.strip()[-500:]}"
    return None


# ---- the isolated run -----------------------------------------------------------------------------------
def _run_isolated(code: str, limits: SandboxConfig, *, stdin: str, mode: str) -> SandboxResult:
    """A run in `mode`, as a host uid of its own (run_user) and, in cgroup mode, in a cgroup of its own."""
    with run_user(limits) as user, \
            run_cgroup(cgroup_parents(), limits) if mode == "cgroup" else contextlib.nullcontext() as cgroup:
        return _run_bwrap(code, limits, stdin=stdin, mode=mode, cgroup=cgroup, user=user)


def _run_bwrap(code: str, limits: SandboxConfig, *, stdin: str, mode: str, cgroup: RunCgroup | None,
               user: int | None) -> SandboxResult:
    program_fd, seccomp_fd = _memfd("program.py", code.encode()), _memfd("seccomp", seccomp_program())
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    python, prefix = _interpreter()
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--ro-bind", "/usr", "/usr", *_root_links(),
            *(() if prefix == "/usr" or prefix.startswith("/usr/") else ("--ro-bind", prefix, prefix)),
            "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", *_host_wide_proc(), *_devices(),
            "--size", str(limits.disk_mb * 2**20), "--tmpfs", WORKDIR,
            "--perms", "0444", "--file", str(program_fd), f"{WORKDIR}/program.py",
            "--remount-ro", "/", "--chdir", WORKDIR,
            "--seccomp", str(seccomp_fd), "--info-fd", str(info_write), "--block-fd", str(block_read),
            python, "-I", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.max_processes),
            str(OPEN_FILES)]
    env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
    # a root trainer starts bwrap as the run's own uid (run_user): the run's user namespace then maps to an
    # unprivileged host uid, and rlimit mode's RLIMIT_NPROC counts the run's processes
    deadline = time.monotonic() + limits.wall_s
    try:
        proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(program_fd, seccomp_fd, info_write, block_read),
                                start_new_session=True, user=user, group=user, extra_groups=[] if user else None)
    except BaseException:
        os.close(info_read)
        os.close(block_write)
        raise
    finally:
        for fd in (program_fd, seccomp_fd, info_write, block_read):
            os.close(fd)
    first = None
    try:
        first = _first_process(proc, info_read, deadline)
        if first is not None:  # bwrap's child waits on block_fd until it is in the run's cgroup and checked
            try:
                _check_not_host_root(first)
                _oom_first(first)
                if cgroup is not None:
                    cgroup.join(first.pid)
            except (ProcessLookupError, FileNotFoundError):  # bwrap's setup failed: its error is on stderr
                pass
            else:
                os.write(block_write, b"x")
        stdout, stderr, timed_out = _communicate(proc, stdin.encode(), cap=limits.output_bytes, deadline=deadline)
    finally:
        _end_run(proc, first, cgroup)
        os.close(block_write)
    returncode = None if timed_out else proc.returncode
    return SandboxResult(returncode, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), mode)


@functools.cache
def _interpreter() -> tuple[str, str]:
    """(python, its prefix) that runs in the sandbox: the trainer's base interpreter, or, for a root trainer
    (whose runs have uids of no account) whose interpreter others may not read (a prefix under /root), the
    system's python of the same version. The probe run fails, naming the path, when neither is there."""
    python, prefix = os.path.realpath(sys._base_executable), os.path.realpath(sys.base_prefix)
    system = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    if os.getuid() == 0 and not (_anyone_can_read(python) and _anyone_can_read(prefix)) and os.path.exists(system):
        return os.path.realpath(system), "/usr"
    return python, prefix


def _anyone_can_read(path: str) -> bool:
    """Whether every directory above `path` is searchable and `path` readable by any user."""
    parts = Path(path).parts
    dirs_ok = all(os.stat(Path(*parts[:i])).st_mode & stat.S_IXOTH for i in range(1, len(parts)))
    return dirs_ok and bool(os.stat(path).st_mode & stat.S_IROTH)


def _devices() -> list[str]:
    """A read-only /dev of a few host nodes (null, zero, full, random, urandom) and the fd links: no pty
    (the machine's ptys are one pool), no /dev/shm, nothing the run can create, chmod or remove."""
    args = ["--tmpfs", "/dev"]
    for name in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        args += ["--symlink", target, f"/dev/{name}"]
    return args + ["--remount-ro", "/dev"]


# What /proc says of the host rather than of the run: the kernel command line, the host's load, memory and
# devices, the kernel's symbols and timers. Each reads empty (where this kernel has it).
HOST_WIDE_PROC = ("cmdline", "loadavg", "meminfo", "vmstat", "zoneinfo", "buddyinfo", "pagetypeinfo", "schedstat",
                  "diskstats", "partitions", "swaps", "interrupts", "softirqs", "kallsyms", "modules",
                  "timer_list", "sched_debug", "key-users", "sysrq-trigger")


def _host_wide_proc() -> list[str]:
    args = []
    for name in HOST_WIDE_PROC:
        if os.path.exists(f"/proc/{name}"):
            # the host's /dev/null (bwrap mounts a plain or a read-only bind nodev, where it is unreadable)
            args += ["--dev-bind", "/dev/null", f"/proc/{name}"]
    return args


def _root_links() -> list[str]:
    """/bin, /sbin and /lib* as on the host: a symlink where the host has one (merged /usr), else a read-only bind."""
    args = []
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return args


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(f"megarl-{name}", 0)  # no MFD_CLOEXEC: passed to bwrap by number
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass(frozen=True)
class _FirstProcess:
    """The run's first process (PID 1 of its PID namespace): its host pid and a pidfd that names it for
    as long as this process holds it, whatever becomes of the pid."""

    pid: int
    pidfd: int


def _first_process(proc: subprocess.Popen, info_fd: int, deadline: float) -> _FirstProcess | None:
    """bwrap's child, named in the JSON bwrap writes to its info fd (read here, then closed), with a pidfd
    taken while it is certainly that child; None when bwrap wrote no such JSON (it failed, or timed out)."""
    info = bytearray()
    with open(info_fd, "rb", buffering=0) as f:
        while (left_s := deadline - time.monotonic()) > 0 and _readable(f.fileno(), left_s):
            chunk = f.read(4096)
            if not chunk:
                break
            info += chunk
            with contextlib.suppress(ValueError, KeyError, TypeError):
                int(json.loads(info)["child-pid"])
                break
        else:
            return None
    try:
        pid = int(json.loads(info)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return None
    try:
        # the pid is bwrap's child, not a process that reused a freed pid: bwrap (not reaped, so its pid is
        # not reused) is that process's parent, and the child cannot exit on its own before block_fd is written
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        parent = None
    if parent != proc.pid:
        os.close(pidfd)
        return None
    return _FirstProcess(pid, pidfd)


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` became readable (a pidfd: its process exited) within `timeout_s` (poll, not select: a
    trainer's fds can be numbered past select's 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _check_not_host_root(first: _FirstProcess) -> None:
    """SandboxUnavailable unless every uid of the run's first process is another one than host root's."""
    with open(f"/proc/{first.pid}/status") as f:
        uids = next(line.split()[1:] for line in f if line.startswith("Uid:"))
    if "0" in uids:
        raise SandboxUnavailable("the sandboxed code would run as host root (uid 0): start the trainer as "
                                 "another user, or as root (megarl then starts each run as a uid of its own)")


def _oom_first(first: _FirstProcess) -> None:
    """The OOM killer takes the run before anything else (oom_score_adj 1000). Set by a root trainer, 1000 is
    also the least the run may set (only a privileged writer sets that floor); _BOOT sets it again in any case."""
    with contextlib.suppress(PermissionError), open(f"/proc/{first.pid}/oom_score_adj", "w") as f:
        f.write("1000")


def _communicate(proc: subprocess.Popen, stdin: bytes, *, cap: int, deadline: float) -> tuple[bytes, bytes, bool]:
    """Feed `stdin`, read stdout and stderr (at most `cap` bytes each: the pipe is closed past that) until
    both are closed and the process exited, or the deadline passed. Returns (stdout, stderr, timed out)."""
    files = {f.fileno(): f for f in (proc.stdin, proc.stdout, proc.stderr)}
    stdin_fd = proc.stdin.fileno()
    stdout, stderr = bytearray(), bytearray()
    buffers = {proc.stdout.fileno(): stdout, proc.stderr.fileno(): stderr}
    pending = memoryview(stdin)
    with selectors.DefaultSelector() as selector:
        for fd, f in files.items():
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_WRITE if f is proc.stdin else selectors.EVENT_READ)
        try:
            while selector.get_map():
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return bytes(stdout), bytes(stderr), True
                for key, _ in selector.select(timeout=left_s):
                    if key.fd == stdin_fd:
                        try:
                            pending = pending[os.write(key.fd, pending[:65536]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        done = not pending
                    else:
                        buffer = buffers[key.fd]
                        chunk = os.read(key.fd, 65536)
                        buffer += chunk[: cap - len(buffer)]
                        done = not chunk or len(buffer) >= cap
                    if done:
                        selector.unregister(key.fd)
                        files[key.fd].close()
        finally:
            for f in files.values():
                f.close()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return bytes(stdout), bytes(stderr), True
    return bytes(stdout), bytes(stderr), False


def _end_run(proc: subprocess.Popen, first: _FirstProcess | None, cgroup: RunCgroup | None) -> None:
    """Kill every process of the run and return once they are all gone.

    SIGKILL to the run's first process, sent through its pidfd (so never to another process), makes the
    kernel kill every other process of its PID namespace, and that first process's exit, which the pidfd
    reports, completes only after all of them are gone. Nothing in the run can prevent it: SIGKILL cannot
    be caught or ignored, and no process of the run can change the first one (_BOOT). This is done after
    every run, whether bwrap is still running or not."""
    if first is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(first.pidfd, signal.SIGKILL)
        if not _readable(first.pidfd, 60):  # only a process stuck in the kernel takes this long
            log.error("sandbox: the run's first process (pid %d) did not exit 60 s after SIGKILL", first.pid)
        os.close(first.pidfd)
        # bwrap reaps its child and exits on its own: killed before that, it would leave the child a zombie of
        # whatever adopts it (this trainer, where it is PID 1 or a subreaper, never reaps it)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    if proc.poll() is None:  # not reaped yet, so its group id is still its own
        with contextlib.suppress(ProcessLookupError):  # bwrap, and by --die-with-parent its child if not known here
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if cgroup is not None:
        cgroup.kill()


# ---- without isolation, and on a service -----------------------------------------------------------------
@functools.cache
def _warn_insecure() -> None:
    log.warning("sandbox.insecure is true: generated code runs WITHOUT isolation, as this user, with this "
                "machine's files and network. Use it for local debugging only.")


def _run_insecure(code: str, limits: SandboxConfig, *, stdin: str) -> SandboxResult:
    """A plain child process with per-process CPU and memory limits in a temporary directory; its process
    group is killed at the end. No isolation at all: what `insecure` means."""
    workdir = tempfile.mkdtemp(prefix="megarl-insecure-")
    try:
        Path(workdir, "program.py").write_text(code, encoding="utf-8")
        args = [sys.executable, "-I", "-c", _BOOT, str(limits.cpu_s), str(limits.memory_mb * 2**20), "0",
                str(OPEN_FILES)]
        proc = subprocess.Popen(args, cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            stdout, stderr, timed_out = _communicate(proc, stdin.encode(), cap=limits.output_bytes,
                                                     deadline=time.monotonic() + limits.wall_s)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        returncode = None if timed_out else proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return SandboxResult(returncode, stdout.decode("utf-8", "replace"),
                             stderr.decode("utf-8", "replace"), "insecure")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_on_service(code: str, limits: SandboxConfig, *, stdin: str) -> SandboxResult:
    """Run `code` on the external sandbox service at `limits.service_url`.

    The protocol: an HTTP POST of the JSON object {"code": str, "stdin": str, "limits": {"cpu_s", "wall_s",
    "memory_mb", "max_processes", "disk_mb", "output_bytes"}}; the answer is the JSON object
    {"returncode": int or null (null: killed at the wall-clock limit), "stdout": str, "stderr": str}, the
    program's exit status and its output. Anything else raises SandboxServiceError."""
    run_limits = {k: v for k, v in asdict(limits).items() if k not in ("insecure", "service_url", "share_uid")}
    body = json.dumps({"code": code, "stdin": stdin, "limits": run_limits}).encode()
    request = urllib.request.Request(limits.service_url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=limits.wall_s + 30) as response:
            answer = json.loads(response.read(4 * limits.output_bytes + 4096))
    except (OSError, ValueError) as e:
        raise SandboxServiceError(f"sandbox service {limits.service_url}: {type(e).__name__}: {e}") from None
    returncode = answer.get("returncode") if isinstance(answer, dict) else None
    if not (isinstance(answer, dict) and (returncode is None or type(returncode) is int)
            and isinstance(answer.get("stdout"), str) and isinstance(answer.get("stderr"), str)):
        raise SandboxServiceError(f"sandbox service {limits.service_url}: expected "
                                  f'{{"returncode": int|null, "stdout": str, "stderr": str}}, got {answer!r:.200}')
    cap = limits.output_bytes
    return SandboxResult(returncode, answer["stdout"][:cap], answer["stderr"][:cap], "service")
