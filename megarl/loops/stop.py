"""Stopping a run on a signal: finish the step, save, say how to resume, exit with a code a launcher reads.

    SIGTERM, SIGUSR1   (a preemption, a job time limit: SLURM's `--signal`)  -> exit code EXIT_TERMINATED (143)
    SIGINT             (Ctrl-C)                                              -> exit code EXIT_INTERRUPTED (130)
    a second SIGINT    raises KeyboardInterrupt at once; the last published checkpoint stays the one to resume

The handler only records the request, so a step or a checkpoint write in progress is never cut short. After
each step the lifecycle asks `StopRequest.agreed()`, one tiny all-reduce over every rank, so that all ranks
stop after the same step and the collective checkpoint save that follows cannot hang on a rank still
stepping. Every rank installs the handlers: torchrun forwards SIGTERM and SIGINT to its workers, and a
terminal sends Ctrl-C to all of them.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

EXIT_TERMINATED = 143  # 128 + SIGTERM, also for SIGUSR1: launch/slurm.sbatch requeues the job on it
EXIT_INTERRUPTED = 130  # 128 + SIGINT

_INTERRUPT, _TERMINATE = 1, 2  # agreed by MAX over the ranks: a termination outranks a Ctrl-C
_KIND = {signal.SIGINT: _INTERRUPT, signal.SIGTERM: _TERMINATE, signal.SIGUSR1: _TERMINATE}


class Stopped(Exception):
    """The run stopped early on a signal after `step`, with its state saved in `checkpoint` (None when no
    step ran since the run started, so there was nothing new to save)."""

    def __init__(self, *, step: int, checkpoint, exit_code: int, signal_name: str):
        super().__init__(f"stopped by {signal_name} after step {step}")
        self.step, self.checkpoint, self.exit_code, self.signal_name = step, checkpoint, exit_code, signal_name


class StopRequest:
    """The signals a run stops on, recorded as they arrive; `install()` sets the handlers in this process
    (main thread only) and `restore()` puts the previous ones back."""

    def __init__(self):
        self.kind = 0
        self.signal_name = ""
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        for signum in _KIND:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.kind:
            raise KeyboardInterrupt
        first = not self.kind
        if _KIND[signum] > self.kind:
            self.kind, self.signal_name = _KIND[signum], signal.Signals(signum).name
        if first and os.environ.get("RANK", "0") == "0":
            # os.write, not print: a handler may run inside a print of the main code
            again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
            os.write(2, f"\nmegarl: {signal.Signals(signum).name}: stopping after this step, then saving a "
                        f"checkpoint{again}\n".encode())

    def agreed(self) -> int:
        """The exit code every rank stops with, or 0 to go on; a collective of all ranks (a MAX all-reduce
        of each rank's request on the device the default group runs on)."""
        kind = self.kind
        if dist.is_initialized() and dist.get_world_size() > 1:
            from megarl.device import current_device

            flag = torch.tensor([kind], dtype=torch.int32, device=current_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            kind = int(flag.item())
        if kind and not self.signal_name:
            self.signal_name = "SIGINT" if kind == _INTERRUPT else "SIGTERM or SIGUSR1"  # another rank's
        return {0: 0, _INTERRUPT: EXIT_INTERRUPTED, _TERMINATE: EXIT_TERMINATED}[kind]


# The request of this process's run: the CLI installs it before any work, the lifecycle asks it after
# each step. Without handlers installed (a loop called from Python), it never asks to stop.
STOP = StopRequest()
