"""Run generated Python code against tests in a separate, limited process: the `code` reward.

What is guaranteed, and by what:
- CPU time, address space and file size (stdout and stderr are files too) are kernel limits
  (setrlimit in the child before the code runs), so each process of the run is bounded.
- Wall-clock time: the parent waits `wall_s`, then SIGKILLs the run's whole process group; the group is
  killed after every run, so nothing is left running whether the code passed, failed or hung.
- When `unshare` can create namespaces (probed once): the child runs in new user, network, PID and mount
  namespaces. No network interface but an unconfigured loopback exists, every mount except the private
  working directory is read-only, and when the child (PID 1 of its namespace) dies the kernel kills every
  process it left. These are kernel guarantees.
- Always, as a second layer and the only one without `unshare`: a Python audit hook in the child refuses
  sockets, process creation (fork, exec, subprocess) and opening files for writing outside the working
  directory. It is a Python-level guard only: code that reaches the system calls another way (ctypes) is
  not stopped by it, which is why the namespaces are used whenever the machine allows them.
RLIMIT_NPROC is not used: the kernel does not apply it to root, which is what trainer processes often are
in containers; the process-creation hook and the PID namespace bound fork bombs instead.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megarl.config import SandboxConfig

# Runs in the child as `python -I -c _BOOT WORKDIR CPU_S MEMORY_BYTES OUTPUT_BYTES ISOLATED`, before the code.
_BOOT = r'''
import ctypes, os, re, resource, sys
workdir, cpu_s, memory_bytes, output_bytes, isolated = sys.argv[1], *map(int, sys.argv[2:6])
if isolated:
    # A fresh mount namespace: keep the working directory writable (a bind mount of itself, made first so
    # it does not inherit read-only), then remount every other mount read-only. A mount the kernel
    # refuses to remount (locked by the parent namespace) keeps its flags; /proc is one.
    libc = ctypes.CDLL(None, use_errno=True)
    MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
    if libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), "sandbox: cannot bind-mount the working directory")
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in f]
    for point in points:
        if point != workdir:
            libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    # This process is PID 1 of the new PID namespace, which ignores signals it has no handler for, the
    # CPU limit's SIGXCPU and SIGKILL included. So the code runs in a child, and PID 1 only passes on its
    # exit status (128 + signal number when a signal ended it).
    pid = os.fork()
    if pid:
        status = os.waitpid(pid, 0)[1]
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
os.chdir(workdir)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (output_bytes, output_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.dont_write_bytecode = True
BLOCKED = {"socket.__new__", "socket.connect", "os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn",
           "os.posix_spawn", "subprocess.Popen", "pty.spawn"}
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
inside = workdir.rstrip("/") + "/"
def guard(event, args):
    if event in BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and not isinstance(args[0], int):
        mode, flags = args[1], args[2]
        writes = (isinstance(flags, int) and flags & WRITE) or (isinstance(mode, str) and set(mode) & set("wax+"))
        if writes and not os.path.realpath(os.fsdecode(args[0])).startswith(inside):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory")
with open("program.py", encoding="utf-8") as f:
    source = f.read()
sys.addaudithook(guard)
sys.argv = ["program.py"]
exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''

_UNSHARE = ("--user", "--map-root-user", "--net", "--pid", "--mount", "--fork", "--kill-child")


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # exit status (a signal shows as 128 + its number or as minus it); None = wall-clock kill
    stdout: str  # at most output_bytes of it
    stderr: str
    isolated: bool  # ran in its own namespaces (see the module docstring)

    @property
    def passed(self) -> bool:
        return self.returncode == 0


@functools.cache
def namespaces_available() -> bool:
    """Whether `unshare` can create the sandbox's namespaces here (user namespaces may be disabled)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, *_UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_python(code: str, limits: SandboxConfig) -> SandboxResult:
    """Run `code` as a Python program in a private temporary directory under `limits`; nothing it started
    is left running afterwards and the directory is removed."""
    isolated = namespaces_available()
    workdir = Path(tempfile.mkdtemp(prefix="megarl-sandbox-")).resolve()
    try:
        (workdir / "program.py").write_text(code, encoding="utf-8")
        prefix = [shutil.which("unshare"), *_UNSHARE] if isolated else []
        args = [*prefix, sys.executable, "-I", "-c", _BOOT, str(workdir), str(limits.cpu_s),
                str(limits.memory_mb * 2**20), str(limits.output_bytes), str(int(isolated))]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "LANG": "C.UTF-8"}
        with open(workdir / "stdout", "wb") as out, open(workdir / "stderr", "wb") as err:
            proc = subprocess.Popen(args, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                returncode = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                _kill_group(proc)
        read = lambda name: (workdir / name).read_bytes()[: limits.output_bytes].decode("utf-8", "replace")
        return SandboxResult(returncode, read("stdout"), read("stderr"), isolated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the child leads it: start_new_session) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of the response (```python ... ``` or ``` ... ```), else the response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def code_reward(response: str, tests: str, limits: SandboxConfig) -> float:
    """1.0 when the response's code followed by `tests` (the row's answer: asserts, or any program that
    exits non-zero on failure) runs to exit status 0 within the limits, else 0.0."""
    return 1.0 if run_python(f"{extract_code(response)}\n\n{tests}\n", limits).passed else 0.0
