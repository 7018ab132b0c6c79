"""Tools the emulated WAN runs inside network namespaces; standard library only.

Run as a script by file path (``python -I netns_tools.py _relay p0 q0 50 0 0``), not with
``python -m``, so that starting one costs a bare interpreter (the p2pdiloco package imports torch).
See :mod:`p2pdiloco.bench.wan` for the topology and the relay's contract. Every tool stops by
itself (time limits; the relay exits when its parent, the harness, is gone).
"""
from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import json
import os
import random
import select
import socket
import struct
import sys
import time
from typing import Sequence

__all__ = ["run_tool"]

_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4
_SIOCETHTOOL = 0x8946
# legacy ethtool "set" commands (linux/ethtool.h): tx-checksum, scatter-gather, TSO, GSO, GRO
_ETHTOOL_OFF = (0x17, 0x19, 0x1F, 0x24, 0x2C)


def _tool_prep(ifaces: Sequence[str]) -> None:
    """Disable IPv6 (no autoconf noise) and TSO/GSO/GRO/checksum offload on ``ifaces``."""
    for path in ("all", "default", *ifaces):
        try:
            with open(f"/proc/sys/net/ipv6/conf/{path}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for ifname in ifaces:
            for cmd in _ETHTOOL_OFF:
                value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
                ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value)).ljust(40, b"\0")
                try:
                    fcntl.ioctl(s.fileno(), _SIOCETHTOOL, ifreq)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise


def _tool_relay(dev_a: str, dev_b: str, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
    """Copy frames a→b after delay/jitter/loss and b→a at once, until the parent dies."""
    parent = os.getppid()  # polled twice a second: exit when the harness is gone
    next_check = 0.0
    socks = {}
    for dev in (dev_a, dev_b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        s.bind((dev, 0))
        s.setblocking(False)
        socks[dev] = s
    a, b = socks[dev_a], socks[dev_b]
    delay, jitter, loss = delay_ms / 1000, jitter_ms / 1000, loss_pct / 100
    rng = random.Random()
    queue: collections.deque = collections.deque()  # (deadline, frame), deadlines non-decreasing
    last_deadline = 0.0
    print("ready", flush=True)

    def send(sock: socket.socket, frame: bytes) -> None:
        try:
            sock.send(frame)
        except OSError as e:  # a full tbf queue drops, as a router would
            if e.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.EMSGSIZE, errno.ENETDOWN):
                raise

    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            send(b, queue.popleft()[1])
        timeout = min(0.5, queue[0][0] - now) if queue else 0.5
        readable, _, _ = select.select([a, b], [], [], max(0.0, timeout))
        if now >= next_check:
            if os.getppid() != parent:
                return
            next_check = now + 0.5
        for sock in readable:
            for _ in range(256):
                try:
                    frame, addr = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == _PACKET_OUTGOING:  # our own transmissions, seen again
                    continue
                if sock is b:
                    send(a, frame)
                elif loss and rng.random() < loss:
                    continue
                elif delay or jitter:
                    deadline = max(last_deadline, time.monotonic() + delay + rng.uniform(-jitter, jitter))
                    last_deadline = deadline
                    queue.append((deadline, frame))
                else:
                    send(b, frame)


def _tool_recv(address: str, seconds: float) -> None:
    srv = socket.create_server((address, 0))
    print(f"PORT {srv.getsockname()[1]}", flush=True)
    srv.settimeout(30)
    conn, _ = srv.accept()
    conn.settimeout(30)
    warmup = min(0.25, seconds / 4)
    first = conn.recv(1 << 20)
    t0 = time.monotonic()
    start, end = t0 + warmup, t0 + seconds
    counted = 0
    while True:
        data = conn.recv(1 << 20)
        now = time.monotonic()
        if not data or now >= end:
            break
        if now >= start:
            counted += len(data)
    elapsed = min(now, end) - start
    conn.close()
    if not first or elapsed <= 0:
        raise SystemExit("connection closed before the measurement window ended")
    print(json.dumps({"bytes": counted, "seconds": elapsed}), flush=True)


def _tool_send(address: str, port: int, limit: float) -> None:
    deadline = time.monotonic() + limit
    sock = socket.create_connection((address, port), timeout=10)
    chunk = b"\0" * (1 << 16)
    sock.settimeout(max(0.1, limit))
    try:
        while time.monotonic() < deadline:
            sock.sendall(chunk)
    except OSError:  # receiver closed: done
        pass
    finally:
        sock.close()


def _tool_echo(address: str) -> None:
    srv = socket.create_server((address, 0))
    print(f"PORT {srv.getsockname()[1]}", flush=True)
    srv.settimeout(30)
    conn, _ = srv.accept()
    conn.settimeout(30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(64)
        if not data:
            return
        conn.sendall(data)


def _tool_ping(address: str, port: int, count: int) -> None:
    sock = socket.create_connection((address, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    for _ in range(count + 1):  # the first round trip warms up ARP and the path
        t = time.perf_counter()
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise SystemExit("echo server closed the connection")
        samples.append((time.perf_counter() - t) * 1000)
    sock.close()
    samples = sorted(samples[1:])
    print(f"{samples[len(samples) // 2]:.3f}", flush=True)


def run_tool(argv: Sequence[str]) -> None:
    """Dispatch ``argv = [tool name, args...]`` to the tool."""
    name, args = argv[0], list(argv[1:])
    if name == "_prep":
        _tool_prep(args)
    elif name == "_relay":
        _tool_relay(args[0], args[1], float(args[2]), float(args[3]), float(args[4]))
    elif name == "_recv":
        _tool_recv(args[0], float(args[1]))
    elif name == "_send":
        _tool_send(args[0], int(args[1]), float(args[2]))
    elif name == "_echo":
        _tool_echo(args[0])
    elif name == "_ping":
        _tool_ping(args[0], int(args[1]), int(args[2]))
    else:
        raise SystemExit(f"unknown tool {name}")


if __name__ == "__main__":
    run_tool(sys.argv[1:])
