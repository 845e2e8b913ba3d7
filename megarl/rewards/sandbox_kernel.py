"""What the kernel enforces on a sandboxed run beyond its namespaces (megarl.rewards.sandbox describes the
whole): the seccomp filter bwrap installs, the run's own cgroup where this process may create one, and the
run's own host uid where this process is root.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import fcntl
import logging
import os
import signal
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megarl.config import SandboxConfig

log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up on this machine; the message says why and what to do."""


SECCOMP_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "unshare",
    "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "syslog",
    "open_by_handle_at", "name_to_handle_at", "userfaultfd", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    # memory the kernel holds for a process outside its address space, which RLIMIT_AS does not bound: memfd,
    # IPC, pages pinned in a pipe by vmsplice (whole huge pages), extended attributes on the run's tmpfs
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open", "vmsplice",
    "setxattr", "lsetxattr", "fsetxattr",
    # channels between concurrent runs, which see the same host files under /usr: locks on a file (flock here,
    # fcntl's lock commands below) and watches of what other runs open
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    # counted per host user, not per run: POSIX timers (RLIMIT_SIGPENDING's queue)
    "timer_create",
    # a session of its own is a scheduler group of its own (autogroup): a run keeps the one bwrap gives it
    "setsid",
)
# System calls newer than the libseccomp of many distributions, denied by number (the same on every
# architecture since Linux 5.1's unified table): setxattrat (Linux 6.13)
SECCOMP_DENIED_NUMBERS = {"setxattrat": 463}
# fcntl commands refused: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW (locks, a
# channel between runs), F_SETLEASE, F_GETLEASE, F_NOTIFY (leases and directory watches), F_SETPIPE_SZ (pipe
# buffers above the host's default)
FCNTL_DENIED = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026, 1031)
UTIME_TIMES_ARG = {"utimensat": 2, "utime": 1, "utimes": 1, "futimesat": 2}  # which argument holds the times
PR_SET_THP_DISABLE = 41  # prctl option: _BOOT sets it for the run; turning it off again is refused
SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK: the only sockets a run may create
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                          0x00000080)


@functools.cache
def seccomp_program() -> bytes:
    """The compiled BPF filter bwrap installs: SECCOMP_DENIED (and SECCOMP_DENIED_NUMBERS), FCNTL_DENIED,
    turning huge pages back on and namespace-creating clone refused with EPERM, clone3 with ENOSYS (so that
    the C library falls back to clone, whose flags the filter can read), sockets of a family not in
    SOCKET_FAMILIES with EAFNOSUPPORT, TCP and unix datagrams with EPROTONOSUPPORT, larger socket buffers
    with EPERM."""
    import pyseccomp as seccomp

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for name in SECCOMP_DENIED:
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError):  # not a system call of this architecture
            continue
    for number in SECCOMP_DENIED_NUMBERS.values():
        f.add_rule(seccomp.ERRNO(errno.EPERM), number)
    for command in FCNTL_DENIED:
        f.add_rule(seccomp.ERRNO(errno.EPERM), "fcntl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, command))
    f.add_rule(seccomp.ERRNO(errno.EPERM), "prctl", seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, PR_SET_THP_DISABLE),
               seccomp.Arg(1, seccomp.EQ, 0))
    # a file's times set to "now", which its write permission allows (its owner alone sets other times): the
    # host's /dev/null, which every run sees, would carry bits between runs in its timestamps
    for call, times in UTIME_TIMES_ARG.items():
        with contextlib.suppress(ValueError, OSError):  # utime, utimes and futimesat are not on every architecture
            f.add_rule(seccomp.ERRNO(errno.EPERM), call, seccomp.Arg(times, seccomp.EQ, 0))
    for flag in CLONE_NAMESPACE_FLAGS:
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for call in ("socket", "socketpair"):  # the family is an int: any value with high bits set is >= 17 too
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.GE, 17))
        for family in set(range(17)) - set(SOCKET_FAMILIES):
            f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, family))
    # no TCP (nor SCTP): its buffers grow to net.ipv4.tcp_rmem and tcp_wmem (MiB per connection), outside
    # RLIMIT_AS and, under cgroup v1, outside the memory cgroup; inet and inet6 datagram sockets remain
    for family in (2, 10):
        for kind in (1, 5):  # SOCK_STREAM, SOCK_SEQPACKET, whatever flags are or-ed in
            f.add_rule(seccomp.ERRNO(errno.EPROTONOSUPPORT), "socket", seccomp.Arg(0, seccomp.EQ, family),
                       seccomp.Arg(1, seccomp.MASKED_EQ, 0xF, kind))
    # no unix datagrams: a datagram sent to a socket stays queued there after its sender closed, so that a
    # process holds the queues of every socket it opened and closed, not only of its open files
    for call in ("socket", "socketpair"):
        f.add_rule(seccomp.ERRNO(errno.EPROTONOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, 1),
                   seccomp.Arg(1, seccomp.MASKED_EQ, 0xF, 2))
    # socket and pipe buffers stay at the host's defaults (net.core.wmem_default, 64 KiB): SO_SNDBUF,
    # SO_RCVBUF and their FORCE forms at SOL_SOCKET are refused (F_SETPIPE_SZ with fcntl's above)
    for option in (7, 8, 32, 33):
        f.add_rule(seccomp.ERRNO(errno.EPERM), "setsockopt", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, 1),
                   seccomp.Arg(2, seccomp.MASKED_EQ, 0xFFFFFFFF, option))
    f.add_rule(seccomp.ERRNO(errno.EPERM), "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, 0x5412))  # TIOCSTI
    fd = os.memfd_create("megarl-seccomp")
    with open(fd, "w+b") as file:
        f.export_bpf(file)
        file.seek(0)
        return file.read()


# ---- cgroups ---------------------------------------------------------------------------------------------
@functools.cache
def cgroup_parents() -> tuple[Path, ...] | None:
    """The cgroups this process may create a run's cgroup under: its own cgroup v2 when the memory and pids
    controllers are delegated to its children, else its own cgroups of the v1 memory and pids hierarchies
    when writable; None when neither."""
    mounts = {}  # fstype or v1 controller -> mount point
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1:]
            if tail[0] == "cgroup2":
                mounts["cgroup2"] = fields[4]
            elif tail[0] == "cgroup":
                for option in tail[2].split(","):
                    mounts.setdefault(option, fields[4])
    own = {}  # "" (v2) or v1 controller -> this process's cgroup path
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path.lstrip("/")
    if "cgroup2" in mounts and "" in own:
        parent = Path(mounts["cgroup2"], own[""])
        delegated = (parent / "cgroup.subtree_control").read_text().split() if parent.is_dir() else []
        if {"memory", "pids"} <= set(delegated) and os.access(parent, os.W_OK):
            return (parent,)
    parents = tuple(Path(mounts[c], own[c]) for c in ("memory", "pids") if c in mounts and c in own)
    if len(parents) == 2 and all(os.access(p, os.W_OK) for p in parents):
        return parents
    return None


@dataclass(frozen=True)
class RunCgroup:
    """One run's cgroup: a directory per hierarchy, limited to the run's memory and processes."""

    dirs: tuple[Path, ...]

    def join(self, pid: int) -> None:
        """Move process `pid` into the run's cgroup (in every hierarchy); what it starts later is in it too."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def kill(self) -> None:
        """SIGKILL whatever is still in the cgroup, then remove it once empty."""
        for d in self.dirs:
            if not d.exists():  # killed and removed already
                continue
            for _ in range(1000):  # a few seconds at most; a killed process leaves the cgroup when reaped
                pids = (d / "cgroup.procs").read_text().split()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.005)
            try:
                d.rmdir()
            except OSError as e:
                log.warning("sandbox: cannot remove cgroup %s: %s", d, e)


_CGROUP_LIMITS = {  # file -> (what it limits, its value from the run's limits); v2 and v1 names
    "memory.max": ("memory", lambda limits: limits.memory_mb * 2**20),
    "memory.swap.max": ("memory", lambda limits: 0),
    "memory.limit_in_bytes": ("memory", lambda limits: limits.memory_mb * 2**20),
    "memory.memsw.limit_in_bytes": ("memory", lambda limits: limits.memory_mb * 2**20),
    # v1 charges socket buffers only to a cgroup with this limit, and to a count of their own
    "memory.kmem.tcp.limit_in_bytes": ("memory", lambda limits: limits.memory_mb * 2**20),
    "pids.max": ("pids", lambda limits: limits.max_processes),
}


@contextlib.contextmanager
def run_cgroup(parents: tuple[Path, ...], limits: SandboxConfig) -> Iterator[RunCgroup]:
    """A new cgroup under each of `parents` with the run's memory and process limits, killed and removed
    on exit; OSError when either limit cannot be set."""
    name = f"megarl-sandbox-{uuid.uuid4().hex}"
    made = []
    try:
        limited = set()
        for parent in parents:
            (parent / name).mkdir()
            made.append(parent / name)
            for file, (what, value) in _CGROUP_LIMITS.items():
                if (parent / name / file).exists():
                    (parent / name / file).write_text(str(value(limits)))
                    limited.add(what)
        if limited != {"memory", "pids"}:
            raise OSError(f"cgroup {name}: cannot limit {' and '.join(sorted({'memory', 'pids'} - limited))}")
        yield RunCgroup(tuple(made))
    finally:
        RunCgroup(tuple(made)).kill()


# ---- the run's host user -------------------------------------------------------------------------------
# A root trainer gives each run a host uid of its own, drawn at random from RUN_UIDS (no account has one):
# what the kernel counts per user (inotify instances, file descriptors in flight, pipe buffer pages, pending
# signals, processes) is then counted per run, and no run can signal another. A lock file per uid held for
# the run keeps two runs of this machine's trainers (that share its temporary directory) off one uid; the
# range is large enough that trainers of other containers on the same kernel rarely draw the same one.
RUN_UIDS = range(0x6D000000, 0x6D000000 + 2**20)


@contextlib.contextmanager
def run_user(limits: SandboxConfig) -> Iterator[int | None]:
    """The host uid a run is started as: a uid of RUN_UIDS held for the run when this process is root; None
    (this process's own uid) otherwise, where runs are one at a time unless `limits.share_uid` (runs of one
    uid would share the kernel's per-user counts: one run could make another's ordinary calls fail)."""
    if os.getuid() != 0 and limits.share_uid:
        yield None
        return
    locks = lock_dir()
    if os.getuid() != 0:
        with _held_lock(locks / "runs", wait=True):
            yield None
        return
    for _ in range(64):
        uid = RUN_UIDS[int.from_bytes(os.urandom(4), "little") % len(RUN_UIDS)]
        with _held_lock(locks / str(uid), wait=False) as held:
            if held:
                yield uid
                return
    raise SandboxUnavailable(f"no free run uid in {RUN_UIDS} after 64 draws (lock files in {locks})")


def lock_dir() -> Path:
    """This uid's folder of run locks in the temporary directory: made 0700, refused unless it is ours."""
    owner = os.geteuid()
    folder = Path(tempfile.gettempdir()) / f"megarl-sandbox-{owner}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner or info.st_mode & 0o077:
        raise SandboxUnavailable(f"{folder} must be a directory of uid {owner} that only it can open")
    return folder


@contextlib.contextmanager
def _held_lock(path: Path, *, wait: bool) -> Iterator[bool]:
    """An exclusive flock(2) on `path` (made if missing), removed when released; yields whether it is held
    (always, when `wait`). The lock is the file's: one that another holder removed is taken again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        held = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # removed (and maybe made again) by the holder before us: lock the file that is there now
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
