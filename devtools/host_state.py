"""A snapshot of what a local cluster could leave behind on the host (kernel settings,
firewall rules, network links, addresses and routes, mounts, cgroups, processes, folders),
and the differences between two snapshots: scripts/cluster/down.sh must leave none.

The machine is shared (CI and other sessions run builds and tests beside a cluster), so
mounts, cgroups, processes and folders are compared only where they carry the cluster's
marks (its name, run folder or store); kernel settings, firewall and links are compared
whole, minus counters the kernel changes by itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Kernel settings that move on their own (counters, entropy, the last pid...).
VOLATILE_SYSCTLS = re.compile(
    r"^(kernel/random/|kernel/ns_last_pid|kernel/pty/nr|fs/(dentry-state|inode-nr|inode-state|"
    r"file-nr|dquot-nr|aio-nr|quota/)|net/netfilter/nf_conntrack_count|kernel/tainted|"
    r"fs/binfmt_misc/|kernel/sched_domain/|net/ipv4/tcp_.*mem_used|vm/stat_refresh|"
    r"kernel/usermodehelper/|net/core/netdev_rss_key|fs/pipe-user-pages|kernel/perf_event_max)"
)
# Folders the node may create on the host if they are missing (node.sh's covers).
NODE_FOLDERS = (
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/etc/cni",
    "/opt/cni",
    "/var/lib/kubelet",
    "/run/containerd",
    "/run/netns",
    "/etc/kubernetes",
    "/opt/containerd",
    "/var/lib/containerd",
)


def sysctls(root: Path = Path("/proc/sys")) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if VOLATILE_SYSCTLS.match(key):
                continue
            try:
                out[key] = path.read_text().strip()
            except OSError:
                continue  # write-only or refused: nothing to compare
    return out


def _run(*cmd: str) -> str:
    if shutil.which(cmd[0]) is None:
        return f"({cmd[0]} not installed)"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return done.stdout


def firewall() -> list[str]:
    """iptables/ip6tables rules and the nftables ruleset, without counters or comments."""
    lines: list[str] = []
    for cmd in (("iptables-save",), ("ip6tables-save",), ("nft", "list", "ruleset")):
        for line in _run(*cmd).splitlines():
            if line.startswith("#"):
                continue
            lines.append(re.sub(r"\[\d+:\d+\]", "", line).rstrip())
    return lines


def network() -> list[str]:
    links = [
        re.sub(r"^\d+: ", "", ln.split("\\")[0]) for ln in _run("ip", "-o", "link").splitlines()
    ]
    links = [re.sub(r" qlen \d+", "", ln) for ln in links]
    addrs = [
        re.sub(r"^\d+: ", "", ln.split("\\")[0]) for ln in _run("ip", "-o", "addr").splitlines()
    ]
    routes = _run("ip", "route", "show", "table", "all").splitlines()
    return (
        sorted(f"link {x}" for x in links)
        + sorted(f"addr {x}" for x in addrs)
        + sorted(f"route {x}" for x in routes)
    )


def mounts() -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        sep = parts.index("-")
        out.append(f"{parts[4]} {parts[sep + 1]} {parts[sep + 2]}")
    return sorted(out)


def cgroups(fs: Path = Path("/sys/fs/cgroup")) -> list[str]:
    out = []
    for hierarchy in sorted(fs.iterdir()) if fs.is_dir() else []:
        for dirpath, _dirs, _files in os.walk(hierarchy):
            out.append(str(Path(dirpath).relative_to(fs)))
    return sorted(out)


def processes() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cgroup = Path(f"/proc/{pid}/cgroup").read_text().replace("\n", ";")
        except OSError:
            continue
        out.append(f"{pid} {cmd.strip()} | {cgroup}")
    return out


def folders() -> list[str]:
    return sorted(p for p in NODE_FOLDERS if os.path.lexists(p))


@dataclass
class HostState:
    sysctls: dict[str, str]
    firewall: list[str]
    network: list[str]
    mounts: list[str]
    cgroups: list[str]
    processes: list[str]
    folders: list[str] = field(default_factory=list)


def snapshot() -> HostState:
    return HostState(sysctls(), firewall(), network(), mounts(), cgroups(), processes(), folders())


def _marked(items: list[str], marks: tuple[str, ...]) -> set[str]:
    return {x for x in items if any(m in x for m in marks)}


def differences(before: HostState, after: HostState, marks: tuple[str, ...]) -> list[str]:
    """What `after` has that `before` had not (or lost): [] when the host is as it was.
    marks: strings that identify the cluster's own mounts, cgroups and processes."""
    diffs = []
    for key in sorted(before.sysctls.keys() | after.sysctls.keys()):
        a, b = before.sysctls.get(key), after.sysctls.get(key)
        if a != b:
            diffs.append(f"sysctl {key}: {a!r} -> {b!r}")
    for name in ("firewall", "network"):
        old, new = set(getattr(before, name)), set(getattr(after, name))
        diffs += [f"{name} added: {x}" for x in sorted(new - old)]
        diffs += [f"{name} removed: {x}" for x in sorted(old - new)]
    for name in ("mounts", "cgroups"):
        old, new = _marked(getattr(before, name), marks), _marked(getattr(after, name), marks)
        diffs += [f"{name} added: {x}" for x in sorted(new - old)]
        diffs += [f"{name} removed: {x}" for x in sorted(old - new)]
    left = _marked(after.processes, marks) - _marked(before.processes, marks)
    diffs += [f"process left running: {x}" for x in sorted(left)]
    diffs += [f"folder added: {x}" for x in sorted(set(after.folders) - set(before.folders))]
    diffs += [f"folder removed: {x}" for x in sorted(set(before.folders) - set(after.folders))]
    return diffs
