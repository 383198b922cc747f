"""An idle warm-pool interpreter: import torch (and friends) now, become a rank later.

Started by the agent as ``python -u -m launcher.pool_process FD MODULES`` with the
pre-import settings of one local rank (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES) already in its
environment. It imports MODULES, then blocks on the unix socket FD the agent gave it for one
order: a msgpack map {env, argv, cwd, module} plus the rank's stdout/stderr as
passed file descriptors. It then turns into that rank exactly as ``python -u SCRIPT ARGS``
(or ``-m MODULE``) would have, minus the seconds of imports.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import runpy
import socket
import sys

from ftlaunch_contract.rank_exit import settle_gloo_workers
from ftlaunch_contract.stack_dump import register_stack_dump


def preload(modules: list[str]) -> None:
    """Import what a training script's start and first optimizer step would import."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional module must not cost the pool slot
            print(f"ftlaunch warm pool: cannot preload {name}: {e}", file=sys.stderr)


def receive_order(sock: socket.socket) -> tuple[dict, list[int]]:
    import msgpack

    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not data:
        os._exit(0)  # the agent closed our socket: we were never needed
    order = msgpack.unpackb(data, raw=False)
    return order, fds


def become(order: dict, fds: list[int]) -> None:
    """Take the rank's streams, environment, directory and argv, then run its code."""
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    register_stack_dump()
    atexit.register(settle_gloo_workers)  # before the script's own: it runs after them
    argv = order["argv"]
    if order["module"]:
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


OWN_PRELOAD = ("zmq", "ftlaunch_contract.protocol")
"""What trainer_shim imports once it finds its agent (~0.1 s here, on the recovery path of
a warm rank). Never trainer_shim itself: it connects at import, and the agent's address
only comes with the order."""


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload([*OWN_PRELOAD, *sys.argv[2:]])
    with contextlib.suppress(OSError):  # the order may already be here, and the agent gone
        sock.sendall(b"R")  # ready: the agent may count on us being warm
    order, fds = receive_order(sock)
    sock.close()
    become(order, fds)


if __name__ == "__main__":
    main()
