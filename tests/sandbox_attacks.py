"""Attacks on the code sandbox, each a function that raises AssertionError when the attack succeeds.

Shared by tests/test_sandbox_attacks.py (in this process's sandbox mode) and, as a script, by the same tests
run as an unprivileged user (`python tests/sandbox_attacks.py` prints {"mode", "failed": {attack: why}}).
Standard library and megarl only, so that a bare interpreter can run it. Each attack sets up what it
attacks itself (a secret file, a listener, a host process) and checks afterwards that nothing of the run is
left on the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megarl.config import SandboxConfig  # noqa: E402
from megarl.rewards import harness  # noqa: E402
from megarl.rewards.code import code_reward  # noqa: E402
from megarl.rewards.sandbox import run_python, sandbox_memory_bound_mb, sandbox_mode  # noqa: E402

LIMITS = SandboxConfig(cpu_s=5, wall_s=20.0, memory_mb=256, max_processes=8, disk_mb=16, output_bytes=4096)


def processes_with(marker: str) -> list[int]:
    """Pids of the processes on the machine whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def open_dir():
    """A temporary directory anyone may read and write, so that only the sandbox can keep code out."""
    with tempfile.TemporaryDirectory(prefix="megarl-attack-") as d:
        os.chmod(d, 0o777)
        yield Path(d)


def run(code: str, **limits) -> str:
    """The run's stdout and stderr, after checking the run left no process behind (any it did are killed
    with their parent, so that a failed attack leaves nothing running either)."""
    marker = f"megarl-attack-{uuid.uuid4().hex}"
    result = run_python(code.replace("MARKER", marker), SandboxConfig(**{**LIMITS.__dict__, **limits}))
    left = processes_with(marker)
    for pid in left:
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            os.kill(pid, signal.SIGKILL)
            if Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"bwrap"):
                os.kill(parent, signal.SIGKILL)
    assert left == [], f"processes of the run outlived it: {left}"
    return result.stdout + result.stderr


# ---- files -------------------------------------------------------------------------------------------------
def attack_read_a_secret_outside():
    with open_dir() as d:
        secret = d / "secret"
        secret.write_text("TOPSECRET-" + uuid.uuid4().hex)
        os.chmod(secret, 0o644)
        out = run(f"import os\nfor p in [{str(secret)!r}, '/etc/shadow', '/etc/passwd', os.path.expanduser('~')]:\n"
                  "    try:\n        print(open(p).read())\n    except OSError as e:\n        print('refused', e)\n")
        assert secret.read_text() not in out and "root:" not in out, out


def attack_write_outside():
    with open_dir() as d:
        targets = [d / "escaped", Path(sys.base_prefix) / "lib" / "escaped.pth", Path("/usr/escaped")]
        out = run("import os\n"
                  f"for p in {[str(t) for t in targets]!r} + ['/escaped', '/dev/escaped', '/dev/shm/escaped']:\n"
                  "    try:\n        open(p, 'w').write('import os')\n        print('WROTE', p)\n"
                  "    except OSError as e:\n        print('refused', p, e.errno)\n")
        assert not any(t.exists() for t in targets) and "WROTE" not in out, out


def attack_remount_and_kernel_interfaces():
    # mount, unshare, setns, ptrace, keyctl, bpf, io_uring straight from libc, past anything Python could hook
    site = Path(sys.base_prefix) / "lib" / "megarl-planted.pth"
    out = run("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "calls = {'remount /': lambda: libc.mount(None, b'/', None, 32 | 4096, None),\n"
              "         'mount tmpfs': lambda: libc.mount(b'x', b'/sandbox', b'tmpfs', 0, None),\n"
              "         'unshare user': lambda: libc.unshare(0x10000000),\n"
              "         'unshare mount': lambda: libc.unshare(0x00020000),\n"
              "         'ptrace pid 1': lambda: libc.ptrace(16, 1, None, None),\n"
              "         'keyctl': lambda: libc.syscall(250, 0, 0, 0, 0),\n"
              "         'bpf': lambda: libc.syscall(321, 0, 0, 0),\n"
              "         'io_uring_setup': lambda: libc.syscall(425, 1, 0),\n"
              "         'setns': lambda: libc.setns(os.open('/proc/1/ns/mnt', os.O_RDONLY), 0)}\n"
              "for name, call in calls.items():\n"
              "    try:\n        print(name, call(), ctypes.get_errno())\n"
              "    except OSError as e:\n        print(name, 'OSError', e.errno)\n"
              f"try:\n    open({str(site)!r}, 'w')\n    print('PLANTED')\n"
              "except OSError as e:\n    print('refused', e)\n")
    for line in out.splitlines()[:9]:
        # EPERM (ENOENT, EACCES: no fd of the first process's namespace, which is closed to the run)
        assert line.split()[-2:] in (["-1", "1"], ["OSError", "1"], ["OSError", "2"], ["OSError", "13"]), out
    assert "PLANTED" not in out and not site.exists(), out


def attack_proc_of_the_host():
    # a host process whose environment holds a secret; the run looks for it in every /proc it can see, and
    # tries to kill it
    secret = "HOSTSECRET-" + uuid.uuid4().hex
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={"TOKEN": secret})
    try:
        out = run("import os, signal\nfound = []\nfor pid in os.listdir('/proc'):\n"
                  "    for name in ('environ', 'cmdline'):\n        try:\n"
                  "            found.append(open(f'/proc/{pid}/{name}', 'rb').read().decode('latin-1'))\n"
                  "        except OSError:\n            pass\n"
                  "print('\\n'.join(found))\nprint('pids', [p for p in os.listdir('/proc') if p.isdigit()])\n"
                  f"try:\n    os.kill({host.pid}, signal.SIGKILL)\n    print('KILLED')\nexcept OSError as e:\n"
                  "    print('refused', e)\n")
        assert secret not in out and "KILLED" not in out and host.poll() is None, out
    finally:
        host.kill()
        host.wait()


def attack_host_root_powers():
    # as host root (even without capabilities) the run could rewrite host-wide kernel settings, chmod the
    # host's device nodes and read root-only files; the run must map to an unprivileged host uid
    with contextlib.ExitStack() as stack:
        secret, text = None, "ROOTONLY-" + uuid.uuid4().hex
        if os.getuid() == 0:  # a root-only file where the run can see it: under the interpreter's prefix
            fd, secret = tempfile.mkstemp(prefix="megarl-attack-", dir=sys.base_prefix)  # mode 0600
            stack.callback(os.unlink, secret)
            os.write(fd, text.encode())
            os.close(fd)
        out = run("import os, stat\n"
                  "for path in ('/proc/sys/kernel/core_pattern', '/proc/sys/kernel/modprobe', '/proc/sysrq-trigger'):\n"
                  "    try:\n        os.close(os.open(path, os.O_WRONLY))\n        print('WRITABLE', path)\n"
                  "    except OSError as e:\n        print('refused', path, e.errno)\n"
                  "for dev in ('/dev/null', '/dev/urandom', '/dev/zero'):\n    try:\n"
                  "        os.chmod(dev, stat.S_IMODE(os.stat(dev).st_mode))\n        print('CHMOD', dev)\n"
                  "    except OSError as e:\n        print('refused', dev, e.errno)\n"
                  f"try:\n    print('READ', open({secret!r}).read())\nexcept (OSError, TypeError) as e:\n"
                  "    print('refused', e)\n")
    assert "WRITABLE" not in out and "CHMOD" not in out and text not in out, out


# x86-64 code that makes a process ignore its parent's death and wait forever: prctl(PR_SET_PDEATHSIG, 0);
# then pause() in a loop. Before that it writes 8 bytes (1: exit status 0) to fd EVENT_FD, which is how
# bubblewrap's own init tells bwrap that the program exited.
_STAY_ALIVE = ("b801000000 bf%s 488d351e000000 ba08000000 0f05 b89d000000 bf01000000 31f6 0f05"  # hex, EVENT_FD at %s
               " b822000000 0f05 ebf7 0100000000000000").replace(" ", "")


def attack_outlive_through_the_init_process():
    # the run's first process is what the trainer kills the run through; the code rewrites that process's
    # memory (/proc/1/mem, no ptrace needed) so that it stays alive, and leaves a daemon behind (run()
    # checks that none outlives the run)
    out = run("import contextlib, os, sys, time\n"
              "SLEEPER = [sys.executable, '-c', 'import time; time.sleep(60)', 'MARKER']\n"
              "if os.fork() == 0:\n    with contextlib.suppress(OSError):  # refused\n        os.setsid()\n"
              "    if os.fork() == 0:\n        os.execv(sys.executable, SLEEPER)\n"
              "    os._exit(0)\n"
              "time.sleep(0.5)\n"
              "try:\n    mem = open('/proc/1/mem', 'r+b', buffering=0)\n    print('OPENED')\n"
              "except OSError as e:\n    print('refused', e)\n    sys.exit(0)\n"
              "events = [int(fd) for fd in os.listdir('/proc/1/fd') if 'eventfd' in os.readlink(f'/proc/1/fd/{fd}')]\n"
              "pc = int(open('/proc/1/syscall').read().split()[-1], 16)\n"
              f"code = bytes.fromhex({_STAY_ALIVE!r} % (events + [1])[0].to_bytes(4, 'little').hex())\n"
              "mem.seek(pc)\nmem.write(code)\nprint('WROTE')\n", wall_s=10.0)
    assert "OPENED" not in out and "WROTE" not in out, out


def attack_memory_outside_the_address_space():
    # memory that is never mapped into a process's address space escapes RLIMIT_AS: memfd pages, SysV
    # shared memory, message queues and semaphore sets, POSIX message queues, socket buffers. Each channel
    # is filled up to STOP MiB (past the run's bound) in its own run; what it held must stay within the bound
    limits = dict(memory_mb=64, max_processes=4, disk_mb=16, wall_s=20.0)
    bound_mb = sandbox_memory_bound_mb(SandboxConfig(**{**LIMITS.__dict__, **limits}))
    stop_mb = bound_mb + 64
    fill = {
        "memfd": "fd = os.memfd_create('x')\ndef step():\n    os.write(fd, CHUNK)\n    return len(CHUNK)\n",
        "sysv shm": "libc.shmat.restype = ctypes.c_void_p\ndef step():\n"
                    "    shm = libc.shmget(0, len(CHUNK), 0o1600)\n    assert shm >= 0, ctypes.get_errno()\n"
                    "    address = libc.shmat(shm, None, 0)\n    ctypes.memset(address, 1, len(CHUNK))\n"
                    "    libc.shmdt(ctypes.c_void_p(address))\n    return len(CHUNK)\n",
        "sysv msg": "buffer = ctypes.create_string_buffer(8 + 8192)\nbuffer[0] = 1\ndef step():\n"
                    "    queue = libc.msgget(0, 0o1600)\n    assert queue >= 0, ctypes.get_errno()\n    sent = 0\n"
                    "    while libc.msgsnd(queue, buffer, 8192, 0o4000) == 0:\n        sent += 8192\n    return sent\n",
        "sysv sem": "def step():\n    sems = libc.semget(0, 32000, 0o1600)\n    assert sems >= 0, ctypes.get_errno()\n"
                    "    return 32000 * 64  # struct sem, about 64 bytes\n",
        "posix mq": "attr = (ctypes.c_long * 8)(0, 10, 8192, 0)\ndef step():\n"
                    "    q = libc.mq_open(f'/q{os.urandom(8).hex()}'.encode(), 0o100 | 2, 0o600, attr)\n"
                    "    assert q >= 0, ctypes.get_errno()\n    for _ in range(10):\n"
                    "        assert libc.mq_send(q, CHUNK[:8192], 8192, 0) == 0, ctypes.get_errno()\n"
                    "    return 81920\n",
        "unix socket buffers": "def step():\n    a, b = socket.socketpair()\n    keep.extend((a, b))\n"
                               "    with contextlib.suppress(OSError):\n"
                               "        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)\n"
                               "    a.setblocking(False)\n    sent = 0\n"
                               "    with contextlib.suppress(BlockingIOError):\n"
                               "        while True:\n            sent += a.send(CHUNK[:65536])\n    return sent\n",
        "tcp buffers": "listener = socket.create_server(('127.0.0.1', 0))\nkeep.append(listener)\ndef step():\n"
                       "    a = socket.create_connection(listener.getsockname())\n    b, _ = listener.accept()\n"
                       "    keep.extend((a, b))\n    a.setblocking(False)\n    sent = 0\n"
                       "    with contextlib.suppress(BlockingIOError):\n        while True:\n"
                       "            sent += a.send(CHUNK[:65536])\n    return sent\n",
        "udp buffers": "def step():\n"
                       "    a, b = socket.socket(type=socket.SOCK_DGRAM), socket.socket(type=socket.SOCK_DGRAM)\n"
                       "    keep.extend((a, b))\n    b.bind(('127.0.0.1', 0))\n    a.setblocking(False)\n    sent = 0\n"
                       "    with contextlib.suppress(BlockingIOError):\n        while sent < (1 << 24):\n"
                       "            sent += a.sendto(CHUNK[:60000], b.getsockname())\n"
                       # SO_MEMINFO's first field: the bytes queued at the receiver
                       "    return int.from_bytes(b.getsockopt(socket.SOL_SOCKET, 55, 36)[:4], 'little')\n",
        "pipe buffers": "import fcntl\ndef step():\n    r, w = os.pipe()\n    keep.extend((r, w))\n"
                        "    with contextlib.suppress(OSError):\n        fcntl.fcntl(w, 1031, 1 << 20)\n"
                        "    os.set_blocking(w, False)\n    sent = 0\n    with contextlib.suppress(BlockingIOError):\n"
                        "        while True:\n            sent += os.write(w, CHUNK[:65536])\n    return sent\n",
        # pages pinned in a pipe by vmsplice outlive their mapping: with huge pages, 2 MiB per pipe slot
        "vmsplice huge pages": "import re\nlibc.mmap.restype = ctypes.c_void_p\n"
                               "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, "
                               "ctypes.c_int, ctypes.c_long]\n"
                               "libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]\n"
                               "libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
                               "def huge_kb():\n    return int(re.search(r'AnonHugePages:\\s+(\\d+)', "
                               "open('/proc/self/smaps_rollup').read()).group(1))\n"
                               "def step():\n    r, w = os.pipe()\n    keep.extend((r, w))\n    pinned = 0\n"
                               "    for _ in range(16):\n"
                               "        a = libc.mmap(None, 4 << 20, 3, 0x22, -1, 0)\n"
                               "        huge = (a + (2 << 20) - 1) & ~((2 << 20) - 1)\n"
                               "        libc.madvise(huge, 2 << 20, 14)  # MADV_HUGEPAGE\n"
                               "        ctypes.memset(huge, 1, 2 << 20)\n        is_huge = huge_kb() > 0\n"
                               "        iov = (ctypes.c_size_t * 2)(huge, 4096)\n"
                               "        if libc.vmsplice(w, iov, 1, 0) <= 0:\n"
                               "            raise OSError(ctypes.get_errno(), 'vmsplice')\n"
                               "        libc.munmap(a, 4 << 20)\n        pinned += (2 << 20) if is_huge else 4096\n"
                               "    return pinned\n",
        # extended attributes on the run's own tmpfs: kernel memory apart from the file's size
        "xattrs on the tmpfs": "def step():\n    name = os.urandom(8).hex()\n    open(name, 'w').close()\n"
                               "    held = 0\n    for i in range(64):\n"
                               "        os.setxattr(name, f'user.v{i}', CHUNK[:60000])\n        held += 60000\n"
                               "    return held\n",
        # datagrams queued at a unix socket stay there after their sender is closed
        "unix datagrams of closed senders": "def step():\n"
                                            "    r = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                                            "    r.bind(f'\\0{os.urandom(8).hex()}')\n    keep.append(r)\n"
                                            "    sent = 0\n    for _ in range(32):\n"
                                            "        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
                                            "        s.setblocking(False)\n"
                                            "        with contextlib.suppress(BlockingIOError):\n"
                                            "            while True:\n"
                                            "                sent += s.sendto(CHUNK[:200000], r.getsockname())\n"
                                            "        s.close()\n"
                                            "    return sent\n",
    }
    held = {}
    for channel, step in fill.items():
        out = run("import contextlib, ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  f"CHUNK = bytes(1 << 20)\nkeep = []\n{step}held = 0\n"
                  f"while held < {stop_mb << 20}:\n    try:\n        more = step()\n"
                  "    except (OSError, AssertionError) as e:\n        print('stopped', repr(e))\n        break\n"
                  "    if (held + more) >> 24 != held >> 24:\n        print('held', (held + more) >> 20, flush=True)\n"
                  "    held += more\nprint('held', held >> 20)\n", **limits)
        held[channel] = max([int(line.split()[1]) for line in out.splitlines() if line.startswith("held")] or [0])
    assert all(mb <= bound_mb for mb in held.values()), (sandbox_mode(), bound_mb, held)


# ---- network and sockets -----------------------------------------------------------------------------------
def attack_network_to_a_host_listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        out = run("import socket\nfor host in ('127.0.0.1', 'localhost', '10.0.0.1'):\n    try:\n"
                  f"        socket.create_connection((host, {port}), timeout=2)\n        print('CONNECTED', host)\n"
                  "    except OSError as e:\n        print('refused', host, e)\n")
        with contextlib.suppress(TimeoutError):
            server.accept()
            raise AssertionError("the sandbox reached a listener of the host")
        assert "CONNECTED" not in out, out


def attack_host_unix_sockets():
    with open_dir() as d, socket.socket(socket.AF_UNIX) as path_server, socket.socket(socket.AF_UNIX) as abstract:
        path = d / "host.sock"
        path_server.bind(str(path))
        os.chmod(path, 0o777)
        path_server.listen()
        name = f"megarl-attack-{uuid.uuid4().hex}"
        abstract.bind("\0" + name)
        abstract.listen()
        out = run("import socket\n"
                  f"for address in [{str(path)!r}, '\\0{name}', '/run/docker.sock', '/var/run/docker.sock']:\n"
                  "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(address)\n"
                  "        print('CONNECTED', address)\n    except OSError as e:\n        print('refused', e)\n")
        assert "CONNECTED" not in out, out


def attack_other_socket_families():
    # vsock reaches the host VM's services and other sandboxes; packet, alg, key and others are kernel
    # surface no program here needs: only unix, inet, inet6 and netlink sockets may be created
    families = {"vsock": 40, "packet": 17, "alg": 38, "key": 15, "appletalk": 5, "tipc": 30, "rds": 21,
                "bluetooth": 31, "can": 29, "xdp": 44, "qipcrtr": 42, "smc": 43, "mctp": 45}
    out = run("import socket\n"
              f"for name, family in {families!r}.items():\n"
              "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, 3):\n"
              "        try:\n            socket.socket(family, kind)\n            print('CREATED', name, kind)\n"
              "        except OSError as e:\n            pass\n"
              "    try:\n        socket.socketpair(family)\n        print('CREATED pair', name)\n"
              "    except OSError:\n        pass\n"
              "print('done')\n")
    assert "CREATED" not in out and "done" in out, out


def attack_take_the_machines_ptys():
    # ptys come from a pool of the whole machine (kernel.pty.max); one run must not drain it
    out = run("import os\nopened = []\nfor _ in range(100):\n    try:\n        opened.append(os.openpty())\n"
              "    except OSError as e:\n        print('refused', e)\n        break\nprint('ptys', len(opened))\n")
    ptys = [int(line.split()[1]) for line in out.splitlines() if line.startswith("ptys")]
    assert ptys == [0], out


# ---- processes and limits ------------------------------------------------------------------------------------
def attack_spawn_and_daemonize():
    # a double-forked daemon, a new session (refused) and a new process group, posix_spawn and spawnv_passfds
    # (no audit event): all must die with the run (run() checks no process with the marker is left)
    out = run("import contextlib, os, subprocess, sys, time, _posixsubprocess\n"
              "SLEEPER = [sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "time.sleep(60)', 'MARKER']\n"
              "if os.fork() == 0:\n    with contextlib.suppress(OSError):  # refused\n        os.setsid()\n"
              "    if os.fork() == 0:\n        os.execv(sys.executable, SLEEPER)\n"
              "    os._exit(0)\n"
              "with contextlib.suppress(OSError):  # a new session is refused\n"
              "    subprocess.Popen(SLEEPER, start_new_session=True)\n"
              "subprocess.Popen(SLEEPER, process_group=0)\n"
              "os.posix_spawn(sys.executable, SLEEPER, {})\n"
              "time.sleep(0.5)\nprint('spawned')\n")
    assert "spawned" in out, out  # processes may be started; what matters is that none outlives the run


def attack_memory_of_the_whole_run():
    # 6 processes of 150 MiB each, all held at once: more than the run's memory in cgroup mode. Each holder
    # reports once its block is allocated, then again when asked after every holder has reported: only a
    # process still alive then answers (one killed to make room for a later one does not), so the second
    # round counts the blocks held at the same time, however slowly the machine ran the first
    mode, chunk_mb, limits = sandbox_mode(), 150, dict(memory_mb=256, max_processes=8)
    out = run("import os\nholders = []\nask_r, ask_w = os.pipe()\nfor _ in range(6):\n    r, w = os.pipe()\n"
              "    try:\n        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        try:\n"
              f"            block = b'x' * ({chunk_mb} << 20)\n        except MemoryError:\n            os._exit(0)\n"
              "        os.write(w, b'1')\n        os.read(ask_r, 1)\n        os.write(w, b'2')\n        os._exit(0)\n"
              "    os.close(w)\n    holders.append(r)\n"
              "reported = [os.read(r, 1) for r in holders]\nos.write(ask_w, b'?' * len(holders))\n"
              "print('holding', sum(os.read(r, 1) == b'2' for r in holders))\n", **limits)
    held = [int(line.split()[1]) for line in out.splitlines() if line.startswith("holding")]
    bound_mb = limits["memory_mb"] * (1 if mode == "cgroup" else limits["max_processes"])
    assert all(n * chunk_mb <= bound_mb for n in held), (mode, out)


def attack_many_processes():
    out = run("import os, time\nstarted = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
              "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
              "    started += 1\nprint('started', started)\n", max_processes=8)
    started = [int(line.split()[1]) for line in out.splitlines() if line.startswith("started")]
    assert started and started[0] < 8, out


def attack_disk_of_the_whole_run():
    out = run("import os\ntotal = 0\nfor name in ('a', 'b', 'c'):\n    try:\n        with open(name, 'wb') as f:\n"
              "            while True:\n                f.write(b'x' * 2**20)\n                f.flush()\n"
              "                total += 1\n    except OSError:\n        pass\nprint('wrote_mib', total)\n", disk_mb=16)
    written = [int(line.split()[1]) for line in out.splitlines() if line.startswith("wrote_mib")]
    assert written and written[0] <= 16, out


def attack_outlive_the_wall_clock():
    # the wall-clock limit ends the run and every process in it, signal handlers notwithstanding
    result = run_python("import os, signal, subprocess, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', 'MARKER'])\n"
                        "time.sleep(60)\n".replace("MARKER", marker := f"megarl-attack-{uuid.uuid4().hex}"),
                        SandboxConfig(**{**LIMITS.__dict__, "wall_s": 2.0}))
    assert result.returncode is None and processes_with(marker) == [], result


# ---- the parent's side of the pipes -------------------------------------------------------------------------
def attack_stdout_symlink_and_fifo():
    os.environ.setdefault("MEGARL_ATTACK_PARENT_SECRET", uuid.uuid4().hex)
    out = run("import os\nfor name, target in (('stdout', '/proc/self/environ'), ('stderr', '/dev/zero')):\n"
              "    os.symlink(target, name)\nos.mkfifo('fifo')\nos.symlink('/proc/1/environ', 'result')\n"
              "print('done')\n")
    assert out == "done\n", out


def attack_flood_stdout():
    result = run_python("import os\nwhile True:\n    os.write(1, bytes(65536))\n", LIMITS)
    assert len(result.stdout) <= LIMITS.output_bytes and not result.passed, result.returncode


# ---- the code reward -------------------------------------------------------------------------------------------
def reward(solution: str, *, expected: str = "'ANSWER-7f3e9'", **limits) -> float:
    tests = json.dumps({"calls": [{"call": "solve(7)", "expected": expected}]})
    return code_reward(f"```python\n{solution}\n```", tests, SandboxConfig(**{**LIMITS.__dict__, **limits}))


# looks for the expected answer in every file and command line the run can see
SCRAPE = """
import os, re, sys
def solve(x):
    seen = []
    for root, dirs, files in os.walk('/'):
        if root.startswith(('/proc', '/usr', '/sys', '/dev', sys.base_prefix)):
            dirs.clear()
            continue
        for f in files:
            try:
                seen.append(open(os.path.join(root, f), errors='ignore').read())
            except OSError:
                pass
    for pid in os.listdir('/proc'):
        try:
            seen.append(open(f'/proc/{pid}/cmdline', errors='ignore').read())
        except OSError:
            pass
    found = re.findall(r'ANSWER-\\w+', ' '.join(seen))
    return found[0] if found else None
"""


def attack_reward_tricks():
    assert reward("def solve(x):\n    return 'ANSWER-7f3e9'") == 1.0  # the right answer scores, so the harness works
    guesses = [harness.digest(json.dumps(harness.encode(v))) for v in (True, False)]
    tricks = {
        "os._exit(0)": "import os\nos._exit(0)",
        "SystemExit": "raise SystemExit(0)",
        "SystemExit in the call": "def solve(x):\n    raise SystemExit(0)",
        "always-true __eq__": "class Yes(str):\n    def __eq__(self, other):\n        return True\n"
                              "    __hash__ = str.__hash__\ndef solve(x):\n    return Yes('ANSWER')",
        "excepthook": "import sys\nsys.excepthook = lambda *a: print('0 ' + '0' * 64)\nraise RuntimeError",
        "atexit": "import atexit, os\natexit.register(lambda: os.write(1, b'0 ' + b'0' * 64 + b'\\n'))\n"
                  "def solve(x):\n    raise ValueError",
        "scrape the tests": SCRAPE,
    }
    scored = {name: reward(code) for name, code in tricks.items()}
    # every guess written straight to the harness's result pipe, for a yes/no task
    guess = ("import os\ndef solve(x):\n    for fd in range(3, 20):\n        try:\n"
             f"            os.write(fd, ''.join(f'0 {{d}}\\n' for d in {guesses!r}).encode())\n"
             "        except OSError:\n            pass\n    return True")
    scored["every guess"] = reward(guess, expected="True")
    # a report line whose index int() refuses to read (more than 4300 digits) must score 0, not raise
    huge = ("import os\ndef solve(x):\n    for fd in range(3, 20):\n        try:\n"
            "            os.write(fd, ('9' * 5000 + ' ' + '0' * 64 + '\\n').encode())\n        except OSError:\n"
            "            pass\n    return None")
    scored["5000-digit index"] = reward(huge, output_bytes=65536)  # the line must fit the cap to be read
    scored["1.0 for 1"] = reward("def solve(x):\n    return 1.0", expected="1")
    scored["True for 1"] = reward("def solve(x):\n    return True", expected="1")
    assert scored == dict.fromkeys(scored, 0.0), scored


def attack_crash_for_an_empty_expected_output():
    # a program that crashes prints nothing: for a case whose expected output is empty, only the exit
    # status tells it from a program that solved it
    tests = json.dumps({"stdin_stdout": [{"stdin": "1\n", "stdout": ""}, {"stdin": "2\n", "stdout": ""}]})
    assert code_reward("import sys\ninput()\n", tests, LIMITS) == 1.0  # a program that prints nothing scores
    crashes = {"exception": "raise RuntimeError", "exit 1": "import sys\nsys.exit(1)",
               "os._exit(3)": "import os\nos._exit(3)", "killed": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "syntax error": "def"}
    scored = {name: code_reward(code, tests, LIMITS) for name, code in crashes.items()}
    assert scored == dict.fromkeys(scored, 0.0), scored


def attack_two_samples_at_once():
    # both runs leave a file and, for 2 s, look for the other's everywhere they can see
    code = ("import os, time\nopen('MINE', 'w').write('x')\nfound = []\nend = time.time() + 2\n"
            "while time.time() < end and not found:\n"
            "    for root, dirs, files in os.walk('/'):\n"
            "        if root.startswith(('/usr', '/sys')):\n            dirs.clear()\n"
            "        found += [f for f in files if f.startswith('megarl-attack-') and f != 'MINE']\n"
            "print('found', found)\n")
    names = [f"megarl-attack-{uuid.uuid4().hex}" for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda n: run_python(code.replace("MINE", n), LIMITS).stdout, names))
    assert outs == ["found []\n", "found []\n"], outs


# ---- between concurrent runs --------------------------------------------------------------------------------
# Both runs see the same host files under /usr: the solver signals the 16 bits of its answer by locking (set
# bits) or not locking one file each, with flock and fcntl's locks, and by opening them; the copier reads the
# locks and watches the files with inotify, and answers with what it read.
RELAY_FILES = ("import os\nFILES = []\nfor name in sorted(os.listdir('/usr/bin')):\n"
               "    path = os.path.join('/usr/bin', name)\n"
               "    if os.path.isfile(path) and not os.path.islink(path) and os.access(path, os.R_OK):\n"
               "        FILES.append(path)\nFILES = FILES[:16]\nRELAY_S = 4.0\n")
RELAY_SOLVER = RELAY_FILES + """
import contextlib, fcntl, struct, time
def solve(x):
    answer = (x * 6062) % 65536
    held = []
    for bit, path in enumerate(FILES):
        if answer >> bit & 1:
            fd = os.open(path, os.O_RDONLY)
            held.append(fd)
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_SH)
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack('hhqqi4x', fcntl.F_RDLCK, 0, 0, 0, 0))
    end = time.time() + RELAY_S
    while time.time() < end:
        for bit, path in enumerate(FILES):
            if answer >> bit & 1:
                os.close(os.open(path, os.O_RDONLY))
        time.sleep(0.01)
    return answer
"""
RELAY_COPIER = RELAY_FILES + """
import contextlib, ctypes, fcntl, select, struct, time
libc = ctypes.CDLL(None, use_errno=True)
def solve(x):
    bits, fds = 0, [os.open(path, os.O_RDONLY) for path in FILES]
    watch = libc.inotify_init1(os.O_NONBLOCK)
    watched = {libc.inotify_add_watch(watch, path.encode(), 0x20): bit for bit, path in enumerate(FILES)} \\
        if watch >= 0 else {}
    end = time.time() + RELAY_S
    while time.time() < end:
        for bit, fd in enumerate(fds):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                bits |= 1 << bit
            except OSError:
                pass
            with contextlib.suppress(OSError):
                lock = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0))
                if struct.unpack('hhqqi4x', lock)[0] != fcntl.F_UNLCK:
                    bits |= 1 << bit
        if watch >= 0 and select.select([watch], [], [], 0)[0]:
            events = os.read(watch, 65536)
            while events:
                wd, _, _, length = struct.unpack('iIII', events[:16])
                if wd in watched:
                    bits |= 1 << watched[wd]
                events = events[16 + length:]
        time.sleep(0.01)
    return bits or None
"""


def attack_a_relay_between_two_runs():
    # GRPO scores a group's samples of one prompt at once: a copier that does not solve the task must not
    # score by reading a solver's answer beside it
    tests = json.dumps({"calls": [{"call": "solve(7)", "expected": str(7 * 6062 % 65536)}]})
    limits = {**LIMITS.__dict__, "wall_s": 30.0}

    def score(solution: str) -> float:
        return code_reward(f"```python\n{solution}\n```", tests, SandboxConfig(**limits))

    assert score(RELAY_SOLVER) == 1.0 and score(RELAY_COPIER) == 0.0  # alone: the solver solves, the copier not
    with ThreadPoolExecutor(2) as pool:
        solver, copier = pool.map(score, (RELAY_SOLVER, RELAY_COPIER))
    assert (solver, copier) == (1.0, 0.0), (solver, copier)


def attack_exhaust_what_the_kernel_counts_per_user():
    # one run takes all it can of what the kernel counts per host user (inotify instances, POSIX timers,
    # file descriptors in flight, pipe buffer pages) and holds it while another run, and the trainer, make
    # ordinary calls
    hog = ("import contextlib, ctypes, os, socket, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "def inotify():\n    n = 0\n    while libc.inotify_init() >= 0:\n        n += 1\n    return n\n"
           "def timers():\n    n, timer = 0, ctypes.create_string_buffer(8)\n"
           "    while n < 100000 and libc.timer_create(1, None, timer) == 0:\n        n += 1\n    return n\n"
           "def in_flight():\n    n = 0\n    with contextlib.suppress(OSError):\n"
           "        a, b = socket.socketpair()\n        a.setblocking(False)\n        keep.extend((a, b))\n"
           "        while True:\n            socket.send_fds(a, [b'x'], [a.fileno()] * 200)\n            n += 200\n"
           "    return n\n"
           "def pipes():\n    n = 0\n    with contextlib.suppress(OSError):\n        while True:\n"
           "            keep.append(os.pipe())\n            n += 1\n    return n\n"
           "keep = []\nfor take in (inotify, inotify, inotify, timers, in_flight, in_flight, pipes, pipes):\n"
           "    if os.fork() == 0:\n        print(take.__name__, take(), flush=True)\n        time.sleep(4)\n"
           "        os._exit(0)\ntime.sleep(4.5)\n")
    ordinary = ("import os, signal, socket, time\ntime.sleep(1.5)\nfailed = []\n"
                "try:\n    r, w = os.pipe()\n    import fcntl\n"
                "    if fcntl.fcntl(w, 1032) < 65536:\n        failed.append('pipe smaller than the default')\n"
                "except OSError as e:\n    failed.append(f'pipe {e}')\n"
                "try:\n    a, b = socket.socketpair()\n    socket.send_fds(a, [b'x'], [r])\n"
                "    socket.recv_fds(b, 1, 1)\nexcept OSError as e:\n    failed.append(f'send_fds {e}')\n"
                "try:\n    signal.setitimer(signal.ITIMER_REAL, 5)\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
                "except OSError as e:\n    failed.append(f'setitimer {e}')\n"
                "print('failed', failed)\n")
    with ThreadPoolExecutor(2) as pool:
        hogged = pool.submit(run, hog, wall_s=20.0, max_processes=16)
        other = pool.submit(run, ordinary, wall_s=20.0)
        time.sleep(2.0)
        r, w = os.pipe()  # the trainer's own calls, while the hog holds what it took
        watch = ctypes.CDLL(None, use_errno=True).inotify_init()
        try:
            assert watch >= 0, f"the trainer's inotify_init failed: errno {ctypes.get_errno()}"
            os.close(watch)
            trainer_pipe = fcntl.fcntl(w, 1032)  # F_GETPIPE_SZ
            a, b = socket.socketpair()
            with a, b:
                socket.send_fds(a, [b"x"], [r])
                os.close(socket.recv_fds(b, 1, 1)[1][0])
        finally:
            os.close(r)
            os.close(w)
        hogged, other = hogged.result(), other.result()
    assert "failed []" in other and trainer_pipe >= 65536, (hogged, other, trainer_pipe)


def attack_a_setsid_farm_takes_one_share():
    # eight busy processes, each in a session of its own where it can: the scheduler gives a session one share
    # (autogroup), so a correct sample pinned to the same core would get 1/9 of the two runs' time; a run is
    # one session. Every process counts its CPU seconds per wall second over the same wall-clock window (or
    # the part of it after it started, on a slow host), whatever else runs here.
    cpu, start = max(os.sched_getaffinity(0)), time.time() + 4.0
    busy = (f"START, END = {start!r}, {start + 3.0!r}\nwhile time.time() < START:\n    pass\n"
            "began, used = time.time(), time.process_time()\nwhile time.time() < END:\n    pass\n"
            "print('cpu', time.process_time() - used, max(time.time() - began, 0.0), flush=True)\n")
    farm = ("import contextlib, os, time\nchildren = 0\nfor _ in range(7):\n    if os.fork() == 0:\n"
            "        children = -1\n        break\n    children += 1\n"
            "with contextlib.suppress(OSError):\n    os.setsid()\n" + busy +
            "for _ in range(max(children, 0)):\n    os.wait()\n")
    sample = "import time\n" + busy

    def pinned(code: str) -> list[tuple[float, float]]:
        os.sched_setaffinity(0, {cpu})  # this thread's, which the sandbox's processes inherit
        out = run(code, wall_s=20.0, cpu_s=20, max_processes=16)
        return [(float(line.split()[1]), float(line.split()[2])) for line in out.splitlines()
                if line.startswith("cpu ")]

    before = os.sched_getaffinity(0)
    with ThreadPoolExecutor(2) as pool:
        farm_cpu, sample_cpu = pool.map(pinned, (farm, sample))
    assert os.sched_getaffinity(0) == before  # the pool's threads were pinned, not this one
    assert len(farm_cpu) == 8 and len(sample_cpu) == 1, (farm_cpu, sample_cpu)
    if os.getuid() != 0:  # a trainer that is not root runs its sandboxes one at a time: one came after the window
        assert sample_cpu[0][1] < 0.5 or max(wall for _, wall in farm_cpu) < 0.5, (farm_cpu, sample_cpu)
        return
    assert all(wall > 1.0 for _, wall in (*farm_cpu, *sample_cpu)), ("the runs barely overlapped", farm_cpu, sample_cpu)
    rate = [used / wall for used, wall in (*farm_cpu, *sample_cpu)]
    share = rate[-1] / sum(rate)
    # one of two groups: 1/2 of what the core gave the two runs; 0.3 tells that from the farm's nine (1/9)
    assert share >= 0.3, (share, farm_cpu, sample_cpu)


def attack_leave_zombies_behind():
    # runs cut off at the wall clock, from a trainer that adopts orphans (a subreaper, as PID 1 of a
    # container is): every process of the runs, and bwrap, must be reaped, none left a zombie of the trainer
    script = ("import ctypes, os, sys\nsys.path.insert(0, sys.argv[1])\n"
              "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER\n"
              "from megarl.config import SandboxConfig\nfrom megarl.rewards.sandbox import run_python\n"
              "for _ in range(6):\n"
              "    run_python('import time\\ntime.sleep(30)', SandboxConfig(cpu_s=5, wall_s=1.0, memory_mb=256))\n"
              "me, zombies = os.getpid(), 0\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
              "    try:\n        fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()\n"
              "    except OSError:\n        continue\n"
              "    zombies += fields[0] == 'Z' and int(fields[1]) == me\nprint('zombies', zombies)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(Path(__file__).resolve().parent.parent)],
                          capture_output=True, text=True, timeout=100)
    assert proc.stdout.split() == ["zombies", "0"], (proc.stdout, proc.stderr[-2000:])


def attack_what_the_run_inherits_and_reads_of_the_host():
    # the trainer's scheduling and locked-memory limits do not carry over; the host's command line and load
    # read empty; a run is the OOM killer's first choice; huge pages stay off
    null_times = os.stat("/dev/null").st_mtime_ns
    out = run("import ctypes, os, resource\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "print('limits', [resource.getrlimit(getattr(resource, name))[1] for name in "
              "('RLIMIT_RTPRIO', 'RLIMIT_NICE', 'RLIMIT_MEMLOCK', 'RLIMIT_MSGQUEUE')])\n"
              "print('policy', os.sched_getscheduler(0) == os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0) >= 0)\n"
              "print('host', [len(open(f'/proc/{name}').read()) for name in ('cmdline', 'loadavg', 'meminfo')])\n"
              "print('oom', open('/proc/self/oom_score_adj').read().strip())\n"
              "print('huge pages off', libc.prctl(42, 0, 0, 0, 0), 'turned on', libc.prctl(41, 0, 0, 0, 0))\n"
              "try:\n    os.utime('/dev/null')\n    print('TOUCHED')\nexcept OSError as e:\n    print('refused', e)\n")
    assert "limits [0, 0, 0, 0]" in out and "policy True True" in out and "host [0, 0, 0]" in out, out
    assert "oom 1000" in out and "huge pages off 1 turned on -1" in out, out
    assert "TOUCHED" not in out and os.stat("/dev/null").st_mtime_ns == null_times, out


ATTACKS = {name: fn for name, fn in globals().items() if name.startswith("attack_")}


def main() -> None:
    """Run every attack; print {"mode": ..., "failed": {attack: why}} as JSON. `--no-cgroup`: as if this
    process could make no cgroup (a root trainer in rlimit mode)."""
    if "--no-cgroup" in sys.argv[1:]:
        import megarl.rewards.sandbox as sandbox

        sandbox.cgroup_parents = lambda: None
    failed = {}
    for name, attack in ATTACKS.items():
        try:
            attack()
        except Exception:  # noqa: BLE001 - report every attack's outcome
            failed[name] = traceback.format_exc()[-1500:]
    print(json.dumps({"mode": sandbox_mode(), "uid": os.getuid(), "failed": failed}))


if __name__ == "__main__":
    main()
