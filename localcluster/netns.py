"""Network-namespace guard for process-backed pods.

EndpointSlices reject loopback addresses, so pods that run as real processes need
addresses outside 127/8. The rule for this project is that such addresses may exist
only inside a network namespace the test run created itself. `enter_private_netns`
moves the calling (still single-threaded) process into a fresh anonymous namespace
whose only interface is `lo`; `is_private_netns` is the check every address-adding
code path makes first, so an address is never added to a shared host interface.
"""
from __future__ import annotations

import ctypes
import os
import subprocess

CLONE_NEWNET = 0x40000000
MARKER_ENV = "HICACHE_PRIVATE_NETNS"


def _links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()]


def is_private_netns() -> bool:
    """True only inside a namespace that has nothing but `lo` (one we made)."""
    try:
        return _links() == ["lo"]
    except (OSError, subprocess.CalledProcessError):
        return False


def enter_private_netns() -> bool:
    """Unshare the network namespace of this process (call before any thread starts).

    Returns True when the process is (now) in a private namespace. Children inherit it,
    and it vanishes with the last process in it, so nothing needs cleaning up.
    """
    if is_private_netns():
        os.environ[MARKER_ENV] = "1"
        return True
    if os.geteuid() != 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return False
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    os.environ[MARKER_ENV] = "1"
    return is_private_netns()


def add_address(ip: str) -> None:
    if not is_private_netns():
        raise RuntimeError(f"refusing to add {ip}: not inside a private network namespace")
    subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", "lo"], check=True,
                   capture_output=True)


def del_address(ip: str) -> None:
    if not is_private_netns():
        return
    subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False,
                   capture_output=True)
