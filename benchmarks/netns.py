"""Emulated nodes for benchmarks: network namespaces, optionally two of them
joined by a veth pair shaped with ``tc tbf`` (needs root).

Each namespace holds only the benchmark's processes, so its interface counters
(/proc/net/dev) see only their traffic."""

from __future__ import annotations

import subprocess


def sh(cmd: str, check: bool = True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def create(names, veth=None, addrs=None, rate: str | None = None) -> None:
    """Creates the namespaces `names` (lo up). With two names and `veth` /
    `addrs` (one per side), joins them by a veth pair addressed /24 and, with
    `rate`, shapes each direction to it. Existing namespaces of these names are
    removed first."""
    remove(names)
    for n in names:
        sh(f"ip netns add {n} && ip netns exec {n} ip link set lo up")
    if veth is None:
        return
    if len(names) != 2 or len(veth) != 2 or len(addrs) != 2:
        raise ValueError("a veth link joins exactly two namespaces")
    sh(f"ip link add {veth[0]} type veth peer name {veth[1]}")
    for dev, addr, n in zip(veth, addrs, names, strict=True):
        sh(f"ip link set {dev} netns {n}")
        sh(f"ip netns exec {n} ip addr add {addr}/24 dev {dev}")
        sh(f"ip netns exec {n} ip link set {dev} up")
        if rate:
            sh(f"ip netns exec {n} tc qdisc add dev {dev} root tbf rate {rate} "
               f"burst 256kb latency 50ms")


def remove(names) -> None:
    for n in names:
        sh(f"ip netns del {n}", check=False)
