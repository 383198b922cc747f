"""Throwaway "machines" on one host: network namespaces on a private bridge.

Node K of a cluster is a network namespace with its own ``eth0`` at 10.200.0.K/24, a hosts
file naming every node and a resolver that asks no one outside (``/etc/netns/<ns>/``,
bind-mounted over /etc by ``ip netns exec``) and, for whatever runs on it, its own
hostname ``nodeK`` (a fresh UTS namespace). Faults are iptables rules inside a node's
namespace: a partition drops everything on its ``eth0``, packet loss drops a random share.
The filesystem and the PID namespace are shared, like a cluster on a shared FSx/EFS whose
processes one can still see from the host.

Every cluster gets unique names (a random id; interface names stay within 15 characters),
and records its owner in ``/run/ftlaunch-netns/<id>.json`` before creating anything, so a
crashed run never breaks the next: ``clean_stale()`` removes clusters whose owner is gone.
Needs root, ``ip`` (iproute2), ``iptables``, ``unshare`` and ``hostname``.

    python scripts/netns.py up 3 --owner $$   # prints the id; stale once $$ is gone
    python scripts/netns.py exec ID 2 -- sh -c 'hostname; ip -br addr'
    python scripts/netns.py down ID
    python scripts/netns.py clean       # clusters whose owner is gone, and stray ftn*/br-ft*
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.200.0"
STATE_DIR = Path("/run/ftlaunch-netns")
NETNS_ETC = Path("/etc/netns")
NS_PREFIX, BRIDGE_PREFIX, VETH_PREFIX = "ftn", "br-ft", "vftn"
LEGACY_LINK = re.compile(r"^(br-ft|vftn|veth-ftn)")  # also the hand-made names of the recipe
TOOLS = ("ip", "iptables", "unshare", "hostname")


def missing_requirements() -> str | None:
    """Why clusters cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"missing {', '.join(missing)} (apt-get install iproute2 iptables util-linux "
                "hostname)")
    return None


def sh(*argv: str, check: bool = True, timeout: float = 15) -> str:
    """Run one command (bounded), return its stdout; raise with its stderr on failure."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (guards against pid reuse), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def namespace_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(ns: str, timeout: float = 10) -> None:
    """SIGKILL every process in ``ns`` until none is left (they may fork meanwhile)."""
    deadline = time.monotonic() + timeout
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # the kernel reaps asynchronously; there is no event to wait on


def _delete_link(name: str) -> None:
    sh("ip", "link", "del", name, check=False)


def _delete_namespace(ns: str) -> None:
    kill_namespace(ns)
    sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


@dataclass
class Node:
    index: int
    ns: str
    veth: str

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index}"

    @property
    def hostname(self) -> str:
        return f"node{self.index}"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this node: in its namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *argv]

    def run(self, *argv: str, check: bool = True) -> str:
        """A quick command in this node's network namespace (hostname unchanged)."""
        return sh("ip", "netns", "exec", self.ns, *argv, check=check)

    def iptables(self, *args: str) -> None:
        self.run("iptables", "-w", "5", *args)

    def partition(self) -> None:
        """Cut this node off: every packet in or out of its eth0 is dropped."""
        self.iptables("-I", "INPUT", "-i", "eth0", "-j", "DROP")
        self.iptables("-I", "OUTPUT", "-o", "eth0", "-j", "DROP")

    def heal(self) -> None:
        self.iptables("-F", "INPUT")
        self.iptables("-F", "OUTPUT")

    def drop_output(self, probability: float, to: str | None = None) -> None:
        """Drop this share of what this node sends (to ``to`` only, if given)."""
        dest = ["-d", to] if to else []
        self.iptables("-A", "OUTPUT", "-o", "eth0", *dest, "-m", "statistic", "--mode",
                      "random", "--probability", f"{probability}", "-j", "DROP")

    def dropped(self) -> int:
        """Packets the rules in this node's OUTPUT chain dropped so far."""
        rules = self.run("iptables", "-w", "5", "-nvxL", "OUTPUT").splitlines()[2:]
        return sum(int(rule.split()[0]) for rule in rules if " DROP " in f" {rule} ")

    def listening(self, port: int) -> bool:
        """Whether something in this namespace listens on TCP ``port``."""
        return f":{port} " in self.run("ss", "-Hltn", f"sport = :{port}") + " "

    def pids(self) -> list[int]:
        return namespace_pids(self.ns)

    def write_hosts(self, entries: list[tuple[str, list[str]]]) -> None:
        """Make this node's hosts file localhost plus ``entries`` (address, names), instead
        of the cluster's nodeK names. Rewritten in place: ``ip netns exec`` bind-mounts the
        file over /etc/hosts, which pins its inode, so what already runs here sees it too."""
        text = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {' '.join(names)}\n" for addr, names in entries)
        with open(NETNS_ETC / self.ns / "hosts", "r+") as f:
            f.write(text)
            f.truncate()


@dataclass
class Cluster:
    size: int = 3
    id: str = field(default_factory=lambda: secrets.token_hex(3))
    owner: int = field(default_factory=os.getpid)
    nodes: list[Node] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.size <= 254:
            raise ValueError("a cluster has 1 to 254 nodes")
        self.bridge = f"{BRIDGE_PREFIX}{self.id}"
        self.nodes = [Node(k, f"{NS_PREFIX}{self.id}-{k}", f"{VETH_PREFIX}{self.id}{k}")
                      for k in range(1, self.size + 1)]
        assert all(len(n) <= 15 for n in [self.bridge, *(n.veth for n in self.nodes)])

    @property
    def record(self) -> Path:
        return STATE_DIR / f"{self.id}.json"

    def node(self, k: int) -> Node:
        return self.nodes[k - 1]

    def up(self) -> Cluster:
        """Build it; on any failure, remove whatever was built and re-raise."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({
            "owner": self.owner, "owner_start": _start_time(self.owner), "bridge": self.bridge,
            "namespaces": [n.ns for n in self.nodes], "veths": [n.veth for n in self.nodes]}))
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{n.addr} {n.hostname}\n" for n in self.nodes)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for n in self.nodes:
            (NETNS_ETC / n.ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / n.ns / "hosts").write_text(hosts)
            # No DNS server but the node's own loopback: lookups fail at once, none leaves.
            (NETNS_ETC / n.ns / "resolv.conf").write_text(
                "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            sh("ip", "netns", "add", n.ns)
            sh("ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0",
               "netns", n.ns)
            sh("ip", "link", "set", n.veth, "master", self.bridge)
            sh("ip", "link", "set", n.veth, "up")
            sh("ip", "-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", "eth0")
            sh("ip", "-n", n.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", n.ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Kill everything inside, delete veths, namespaces, bridge and record (idempotent)."""
        teardown(self.bridge, [n.ns for n in self.nodes], [n.veth for n in self.nodes])
        self.record.unlink(missing_ok=True)

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def teardown(bridge: str, namespaces: list[str], veths: list[str]) -> None:
    for ns in namespaces:
        kill_namespace(ns)
    for veth in veths:  # explicitly: a namespace's deletion removes its peer only lazily
        _delete_link(veth)
    for ns in namespaces:
        _delete_namespace(ns)
    _delete_link(bridge)


def _owner_alive(record: dict) -> bool:
    start = _start_time(record["owner"])
    return start is not None and start == record.get("owner_start")


def clean_stale() -> list[str]:
    """Remove clusters whose owner is gone, and stray ``ftn*``/``br-ft*`` leftovers that no
    live cluster owns (left alone if processes still run in them). Returns what was removed."""
    removed: list[str] = []
    live: set[str] = set()
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    for path in STATE_DIR.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        names = [record["bridge"], *record["namespaces"], *record["veths"]]
        if _owner_alive(record):
            live.update(names)
            continue
        teardown(record["bridge"], record["namespaces"], record["veths"])
        path.unlink(missing_ok=True)
        removed += names
    namespaces = [line.split()[0] for line in sh("ip", "netns", "list").splitlines()
                  if line.startswith(NS_PREFIX)]
    links = [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", sh("ip", "-o", "link", "show"),
                                             re.MULTILINE)]
    stray_ns = [ns for ns in namespaces if ns not in live]
    stray_links = [name for name in links if LEGACY_LINK.match(name) and name not in live]
    busy = [ns for ns in stray_ns if namespace_pids(ns)]
    if busy:
        print(f"netns: leaving {busy} (and stray links) alone: processes still run there",
              file=sys.stderr)
        return removed
    teardown_links = [name for name in stray_links if not name.startswith(BRIDGE_PREFIX)]
    bridges = [name for name in stray_links if name.startswith(BRIDGE_PREFIX)]
    for ns in stray_ns:
        _delete_namespace(ns)
    for name in teardown_links + bridges:
        _delete_link(name)
    if NETNS_ETC.is_dir():
        for path in NETNS_ETC.glob(f"{NS_PREFIX}*"):
            if path.name not in live:
                shutil.rmtree(path, ignore_errors=True)
    return removed + stray_ns + stray_links


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster; prints its id")
    up.add_argument("size", type=int, nargs="?", default=3)
    up.add_argument("--owner", type=int, default=os.getppid(),
                    help="pid whose death makes the cluster stale (default: the caller)")
    down = sub.add_parser("down", help="tear a cluster down")
    down.add_argument("id")
    ex = sub.add_parser("exec", help="run a command on node K (own hostname)")
    ex.add_argument("id")
    ex.add_argument("k", type=int)
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("clean", help="remove stale clusters and stray leftovers")
    args = p.parse_args()
    if (why := missing_requirements()) is not None:
        print(f"netns: {why}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        print(Cluster(args.size, owner=args.owner).up().id)
    elif args.cmd == "down":
        record = json.loads((STATE_DIR / f"{args.id}.json").read_text())
        teardown(record["bridge"], record["namespaces"], record["veths"])
        (STATE_DIR / f"{args.id}.json").unlink()
    elif args.cmd == "exec":
        record = json.loads((STATE_DIR / f"{args.id}.json").read_text())
        node = Node(args.k, record["namespaces"][args.k - 1], record["veths"][args.k - 1])
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        os.execvp("ip", node.command(argv))
    else:
        for name in clean_stale():
            print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
