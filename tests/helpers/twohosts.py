"""Two "hosts" on one machine for launch tests: network namespaces joined by a veth pair, sshd in each.

Each namespace has its own address on an interface named ``hv0`` (the same name on both hosts, as on
a real cluster) and an sshd that accepts a key generated for the test. Everything is torn down on
exit -- daemons, namespaces (with their links) and known_hosts entries -- even when the test fails.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import List

IFACE = "hv0"


def namespaces_supported() -> str:
    """Empty string if namespaces and sshd are usable here, else the reason they are not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not os.path.exists("/usr/sbin/sshd"):
        return "needs iproute2 and openssh-server (scripts/setup.sh installs them)"
    probe = f"hvdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class TwoHosts:
    """Context manager; ``hosts[i]`` is the address of host ``i``, ``exec_on(i, argv)`` prefixes argv to run there."""

    def __init__(self, workdir: Path, subnet: str = "10.233.71"):
        self.dir = Path(workdir)
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"hvdA{tag}", f"hvdB{tag}"]
        self.hosts = [f"{subnet}.1", f"{subnet}.2"]
        self.key = self.dir / "id_ed25519"
        self._daemons: List[subprocess.Popen] = []

    # ---- set-up / tear-down -------------------------------------------------------------------
    def __enter__(self) -> "TwoHosts":
        try:
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _create(self) -> None:
        a, b = self.namespaces
        for ns, host in zip(self.namespaces, self.hosts):
            _run("ip", "netns", "add", ns)
            # As on a cluster, this machine's hostname resolves to the host's own address: Horovod
            # 0.28.1 binds Gloo's process-set connections to the hostname's address, whatever the
            # interface flags say. `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{host} {socket.gethostname()}\n")
        _run("ip", "link", "add", f"v{a}"[:15], "type", "veth", "peer", "name", f"v{b}"[:15])
        for ns, end, host in zip(self.namespaces, (f"v{a}"[:15], f"v{b}"[:15]), self.hosts):
            _run("ip", "link", "set", end, "netns", ns)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", end, "name", IFACE)
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{host}/24", "dev", IFACE)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", IFACE, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            # IPv4 only: Gloo takes an interface's first address, and an IPv6 link-local one is unusable.
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_key"))
        shutil.copy(f"{self.key}.pub", self.dir / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for i, (ns, host) in enumerate(zip(self.namespaces, self.hosts)):
            config = self.dir / f"sshd_config_{i}"
            config.write_text("\n".join([
                f"ListenAddress {host}", "Port 22", f"HostKey {self.dir / 'host_key'}",
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "StrictModes no", "UsePAM no",
                f"PidFile {self.dir / f'sshd_{i}.pid'}", "MaxStartups 100", ""]))
            self._daemons.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdout=subprocess.DEVNULL, stderr=open(self.dir / f"sshd_{i}.log", "w")))
        for host in self.hosts:  # wait until each sshd answers, from the other host
            for _ in range(100):
                probe = subprocess.run(self.exec_on(0, ["ssh", *self.ssh_options(), f"root@{host}", "true"]),
                                       capture_output=True)
                if probe.returncode == 0:
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError(f"sshd on {host} does not answer: {probe.stderr.decode()[-500:]}")

    def __exit__(self, *exc) -> None:
        for daemon in self._daemons:
            daemon.kill()
            daemon.wait()
        for ns in self.namespaces:
            # Ends whatever still runs there (ranks left by a failed test), then the namespace.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        for host in self.hosts:  # horovodrun's ssh records the test host keys in root's known_hosts
            subprocess.run(["ssh-keygen", "-R", host], capture_output=True)
        for name in ("id_ed25519", "host_key", "authorized_keys"):
            for path in self.dir.glob(f"{name}*"):
                path.unlink()

    # ---- use --------------------------------------------------------------------------------------
    def ssh_options(self) -> List[str]:
        return ["-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]

    def exec_on(self, host: int, argv: List[str]) -> List[str]:
        """``argv`` run inside host ``host``'s network namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def cut_link(self) -> None:
        """Take the link between the hosts down (packets vanish; no connection is reset)."""
        for ns in self.namespaces:
            _run("ip", "netns", "exec", ns, "ip", "link", "set", IFACE, "down")
