"""Multi-process runs on ``jax.distributed``: one process's part of a group (``Distributed``,
from ``jaxkv generate --coordinator HOST:PORT --num-processes N --process-id I``), and
``jaxkv launch``, which starts the N processes of one ``generate`` command on this machine:

    jaxkv launch --num-processes 2 --devices-per-process 4 -- generate --mesh data=2,model=4 --prompt a --prompt b

Every process runs the same program over one global mesh (``--mesh`` sizes multiply to all
processes' devices); only process 0 prints the generated text. The launcher forwards process
0's output; when a process fails or the timeout passes it stops the others and names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOCALHOST = "127.0.0.1"
TAIL_LINES = 20  # of a failed process's stderr, in the launcher's report
POLL_SECONDS = 0.1
STOP_SECONDS = 5.0  # between asking a process to stop (SIGTERM) and killing it

SAME_PROGRAM_HELP = (
    "Every process runs the same program over one mesh spanning all processes' devices (--mesh sizes multiply to "
    "their total); the cache is sized from the configuration (prompt + max_new_tokens, or --max-length), never from "
    "a process's free memory, so every process builds the same one. Only process 0 prints the text."
)


@dataclasses.dataclass(frozen=True)
class Distributed:
    """This process's place in a ``jax.distributed`` group of ``num_processes``."""

    coordinator: str  # HOST:PORT where process 0 serves the group's coordination
    num_processes: int
    process_id: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Distributed | None:
        """From ``--coordinator``, ``--num-processes`` and ``--process-id`` (None when none is
        given); errors name the missing or wrong flag."""
        flags = (args.coordinator, args.num_processes, args.process_id)
        if all(flag is None for flag in flags):
            return None
        if any(flag is None for flag in flags):
            raise ValueError(
                "a multi-process run needs all of --coordinator HOST:PORT, --num-processes N and --process-id I "
                "(jaxkv launch --num-processes N -- generate ... sets them)"
            )
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--coordinator {args.coordinator!r}: expected HOST:PORT, e.g. {LOCALHOST}:12345")
        check_positive("--num-processes", args.num_processes)
        if not 0 <= args.process_id < args.num_processes:
            raise ValueError(
                f"--process-id {args.process_id} is out of range for --num-processes {args.num_processes}: "
                f"give 0 to {args.num_processes - 1}"
            )
        return cls(args.coordinator, args.num_processes, args.process_id)

    def initialize(self) -> None:
        """Join the group. Must come before any JAX backend use: the backend is then built over
        every process's devices. The coordination service listens only on ``coordinator``.

        Gloo prints its connection lines on the C++ stdout (file descriptor 1), which must carry
        only the generated text: from here on that descriptor is stderr's, and Python's
        ``sys.stdout`` writes to the original stdout."""
        import jax

        sys.stdout.flush()
        sys.stdout = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        jax.distributed.initialize(
            self.coordinator, self.num_processes, self.process_id, coordinator_bind_address=self.coordinator
        )


def check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{flag} must be at least 1, got {value}")


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id`` (one process of a group)."""
    group = parser.add_argument_group("multi-process (jax.distributed; jaxkv launch sets these)", SAME_PROGRAM_HELP)
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, which every process joins")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the group")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0 to N-1")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "launch",
        help="run one generate command as N local processes of a jax.distributed group",
        description=f"jaxkv launch --num-processes N [options] -- generate ARGS. {SAME_PROGRAM_HELP}",
    )
    parser.add_argument("--num-processes", type=int, required=True, metavar="N", help="processes to start")
    parser.add_argument(
        "--devices-per-process", type=int, metavar="K",
        help="CPU devices each process sees (JAX_NUM_CPU_DEVICES; default: leave the platform's devices)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, help=f"coordinator port on {LOCALHOST} (default: a free one)")
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="seconds before every process is stopped (default: no limit)"
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- generate ARGS (the command each process runs)")


@dataclasses.dataclass
class Worker:
    """One launched process and the files its output goes to."""

    index: int
    process: subprocess.Popen
    stdout: Path
    stderr: Path

    @classmethod
    def start(cls, index: int, command: list[str], env: dict[str, str], logs: Path) -> Worker:
        stdout, stderr = logs / f"{index}.out", logs / f"{index}.err"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            return cls(index, subprocess.Popen(command, stdout=out, stderr=err, env=env), stdout, stderr)

    def last_stderr(self) -> str:
        lines = self.stderr.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        return "\n".join(f"    {line}" for line in lines) or "    (nothing)"


def run(args: argparse.Namespace) -> int:
    """Start the processes, wait for them all (or the first failure, or the timeout), stop the
    rest, then forward process 0's output or report what went wrong."""
    command = launched_command(args.program)
    check_positive("--num-processes", args.num_processes)
    coordinator = f"{LOCALHOST}:{args.port or free_port()}"
    env = dict(os.environ)
    if args.devices_per_process is not None:
        check_positive("--devices-per-process", args.devices_per_process)
        env["JAX_NUM_CPU_DEVICES"] = str(args.devices_per_process)
    with tempfile.TemporaryDirectory(prefix="jaxkv-launch-") as logs:
        workers = []
        try:
            for index in range(args.num_processes):
                flags = ["--coordinator", coordinator, "--num-processes", str(args.num_processes)]
                process_command = [sys.executable, "-m", "jaxkv.cli", *command, *flags, "--process-id", str(index)]
                workers.append(Worker.start(index, process_command, env, Path(logs)))
            problem = watch(workers, args.timeout)
        finally:
            stop(workers)
        if problem:
            print(f"jaxkv launch: {problem}", file=sys.stderr)
            return 1
        sys.stdout.write(workers[0].stdout.read_text())
        sys.stderr.write(workers[0].stderr.read_text())
    return 0


def stop(workers: list[Worker]) -> None:
    """Ask every running process to stop (SIGTERM), then kill those still running after ``STOP_SECONDS``."""
    running = [worker.process for worker in workers if worker.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def launched_command(command: list[str]) -> list[str]:
    """``-- generate ARGS`` as the arguments each process gets (the launcher adds its flags)."""
    command = command[1:] if command[:1] == ["--"] else command
    if command[:1] != ["generate"]:
        raise ValueError("jaxkv launch runs a generate command: jaxkv launch --num-processes N -- generate ARGS")
    given = sorted({arg.partition("=")[0] for arg in command} & {"--coordinator", "--num-processes", "--process-id"})
    if given:
        raise ValueError(f"jaxkv launch sets {', '.join(given)} for each process: leave them out of the command")
    return command


def free_port() -> int:
    """A port nothing listens on now (the OS's pick), for the coordinator."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOCALHOST, 0))
        return probe.getsockname()[1]


def watch(workers: list[Worker], timeout: float | None) -> str | None:
    """Wait until every process has exited 0 (None), one has failed, or ``timeout`` seconds have
    passed; then what went wrong, with the failed (or still running) processes' last stderr lines."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [worker.process.poll() for worker in workers]
        failed = [worker for worker, code in zip(workers, codes) if code not in (None, 0)]
        if failed:
            return "\n".join(
                f"process {w.index} of {len(workers)} failed (exit code {w.process.returncode}); its last stderr "
                f"lines:\n{w.last_stderr()}"
                for w in failed
            )
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            running = [worker for worker, code in zip(workers, codes) if code is None]
            return f"timed out after {timeout:g} s\n" + "\n".join(
                f"process {w.index} of {len(workers)} was still running, stopped; its last stderr lines:\n"
                f"{w.last_stderr()}"
                for w in running
            )
        time.sleep(POLL_SECONDS)
