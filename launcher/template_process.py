"""The rank template: one interpreter per node that imports torch once, then forks ranks.

Started by the agent as ``python -u -m launcher.template_process FD MODULES`` (its own
process group, killed with the agent). It imports MODULES, checks it is safe to fork (one
thread, no CUDA context, no process group) and says so on the unix socket FD, then serves
fork orders: a msgpack map {argv, env, cwd, module, title, name} plus the rank's stdout/stderr as
passed descriptors. Each child turns into the rank exactly as ``python -u SCRIPT ARGS`` (or
``-m MODULE``) would have, minus the seconds of imports; the template replies with its pid,
reaps it when it exits and reports the exit status (only a parent can read it).

Messages to the agent (msgpack maps): ``{"ready": seconds}`` or ``{"unsafe": why}`` once,
``{"forked": pid}`` per order, ``{"exited": pid, "code": returncode}`` per rank.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import os
import random
import runpy
import select
import signal
import socket
import sys
import time
from typing import Any

import msgpack

from ftlaunch_contract.rank_exit import before_finalize
from ftlaunch_contract.stack_dump import register_stack_dump

OWN_PRELOAD = ("zmq", "ftlaunch_contract.protocol", "ftlaunch_contract.shards",
               "ftlaunch_contract.staging", "ftlaunch_contract.reshard")
"""What trainer_shim and its AsyncCheckpointer import once it finds its agent (~0.1 s here,
on the recovery path: a forked rank's peers wait for it in their first collective). Never
trainer_shim itself: it connects at import, and the agent's address comes with the order."""

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
_libc = ctypes.CDLL(None, use_errno=True)


def preload(modules: list[str]) -> None:
    """Import what a training script's start and first optimizer step would import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional module must not cost the template
            print(f"ftlaunch rank template: cannot preload {name}: {e}", file=sys.stderr)


def fork_unsafe() -> str | None:
    """Why forking this process would hand ranks a broken copy, or None: another thread
    (its lock states and its absence in the child), a CUDA context or a process group
    (neither survives a fork)."""
    tasks = os.listdir("/proc/self/task")
    if len(tasks) > 1:
        names = sorted(_thread_name(t) for t in tasks if int(t) != os.getpid())
        return f"{len(tasks)} threads run in it ({', '.join(names)})"
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return "CUDA is initialised in it"
        distributed = sys.modules.get("torch.distributed")
        if distributed is not None and distributed.is_available() and distributed.is_initialized():
            return "a torch.distributed process group exists in it"
    return None


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return tid


def become(order: dict[str, Any], fds: list[int], template_pid: int) -> None:
    """In the forked child: be the rank as a fresh ``python -u`` would be, then run it."""
    os.setpgid(0, 0)  # its own group: stopping the rank stops its children
    _leave_template(template_pid, rank=True)
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    _fresh_interpreter_state()
    set_title(order["title"], order["name"])
    register_stack_dump()
    atexit.register(before_finalize)  # before the script's own: it runs after them
    argv = order["argv"]
    if order["module"]:
        sys.argv = list(argv)
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2)
"""What a scheduler may send every process of a job step (scancel, SLURM's time limit and
preemption): the ranks must get them with their default action, as fresh interpreters
would; the template and the store ignore them (the agent ends those), so a preemption
does not kill the ranks' template, or the store their last save needs, under them."""


def _leave_template(template_pid: int, rank: bool) -> None:
    """In a forked child: die with the template (as it dies with the agent), and drop
    what the template set up to hear of its children; a ``rank`` gets the stop signals'
    default actions back."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != template_pid:  # the template died before prctl took effect
        os._exit(1)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for sig in STOP_SIGNALS if rank else ():  # SIGINT: Python's KeyboardInterrupt, as fresh
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_DFL)


def serve_store(addr: str, port: int, listening: int, template_pid: int) -> None:
    """In a forked child: serve torch's TCPStore for one attempt on the socket the agent
    bound, until killed (by the agent, or with the template)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    _leave_template(template_pid, rank=False)
    set_title(f"ftlaunch store {addr}:{port}", "ftlaunch-store")
    store = TCPStore(addr, port, None, True, timedelta(seconds=300), wait_for_workers=False,
                     master_listen_fd=listening, use_libuv=True)
    while store is not None:
        signal.pause()


def _fresh_interpreter_state() -> None:
    """What a fresh interpreter has and a fork would share: Python's, numpy's and torch's
    default random state seeded from the OS (as a fresh interpreter's are: two ranks never
    share a seed they did not choose), torch's thread count from OMP_NUM_THREADS. The atexit handlers are those the preloaded modules registered, as
    the script's own imports would have (the template registers none of its own)."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")  # else OpenMP's default: our cores
        torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                              else len(os.sched_getaffinity(0)))


def set_title(title: str, name: str) -> None:
    """Show ``title`` as the command line in ``ps`` (/proc/PID/cmdline, within the space of
    the template's own) and ``name`` as the process name (/proc/PID/comm, 15 bytes), so
    tools can tell ranks apart."""
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        text = title.encode()[:end - start - 1]
        ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    except (OSError, ValueError, IndexError):
        pass  # the title is a convenience; the rank runs either way


def _send(sock: socket.socket, **message: Any) -> None:
    with contextlib.suppress(OSError):  # the agent gone: PDEATHSIG ends us
        sock.send(msgpack.packb(message))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, exited=pid, code=os.waitstatus_to_exitcode(status))


def serve(sock: socket.socket) -> None:
    """Fork a rank per order; report each exit. Ends when the agent closes the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not data:
            return  # the agent is done with us; its ranks are gone
        order = msgpack.unpackb(data, raw=False)
        unsafe = fork_unsafe()
        if unsafe is not None:  # something started since we said ready
            for fd in fds:
                os.close(fd)
            _send(sock, unsafe=unsafe)
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            os.close(wake_r)
            os.close(wake_w)
            if "store" in order:
                addr, port = order["store"]
                serve_store(addr, port, fds[0], me)
            become(order, fds, me)
            sys.exit(0)  # the script ended: exit as the interpreter would, atexit and all
        for fd in fds:
            os.close(fd)
        _send(sock, forked=pid)


def main() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    started = time.monotonic()
    os.environ["OMP_NUM_THREADS"] = "1"  # else importing torch starts OpenMP's threads
    # No collection while importing: each full one traverses all torch made so far, and
    # they took a fifth of the imports (1.78 -> 1.42 s here). The few thousand objects of
    # import-time garbage are kept, as everything else the imports made.
    gc.disable()
    preload([*OWN_PRELOAD, *sys.argv[2:]])
    # What the imports made lives as long as the ranks: frozen, a rank's collections do not
    # traverse it (nor touch, and so copy, the template's pages each time).
    gc.freeze()
    gc.enable()  # (the ranks collect as any interpreter does)
    unsafe = fork_unsafe()
    if unsafe is not None:
        _send(sock, unsafe=unsafe)
        return
    _send(sock, ready=time.monotonic() - started)
    serve(sock)


if __name__ == "__main__":
    main()
