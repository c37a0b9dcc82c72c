"""A GlusterFS volume served from one emulated host and mounted on others: the network
filesystem under vLLM's ``fs`` tier when its engines run on hosts of their own (root
only; Linux; Debian's ``glusterfs-server`` and ``glusterfs-client``).

::

    with GlusterVolume(server_netns=storage.netns, server_address=storage.address,
                       workdir=run_dir / "gluster") as vol:
        root = vol.mount(client_netns=engine.netns, mountpoint=run_dir / "mnt-0")
        ...  # engines started later with ``ip netns exec ENGINE_NS`` use ``root``

Why it is built this way:

- **glusterd and its brick run on the server's host**, in its network namespace (``ip
  netns exec``), bound to its address (``transport.socket.bind-address``, which glusterd
  hands the brick too): the volume is reached over that host's link only.
- **A run's state is in its workdir.** glusterd reads the run's volfile
  (``workdir/glusterd.vol``): ``working-directory``, ``run-directory`` (pid files),
  ``logging-directory`` and ``glusterd-sockfile`` (the CLI's socket: ``gluster
  --glusterd-sock``). No option of GlusterFS 10.3 moves the paths compiled in: the
  bricks' sockets (``/var/run/gluster/<hash>.socket``), ``/var/run/gluster/snaps``,
  ``/var/lib/glusterd/ss_brick`` and ``/var/lib/glusterd/geo-replication/`` (written by
  ``gsyncd --version``, which the ``gluster`` CLI runs on every call). So glusterd runs
  in the mount namespace ``ip netns exec`` makes (its ``/`` a slave: nothing reaches the
  machine's) with ``workdir/host/*`` bound over those directories (:data:`PINNED`), and
  the CLI joins it (``nsenter --target GLUSTERD --mount``): a glusterd of the machine's
  is never touched, two runs never clash. A missing one of those directories is made,
  empty, as the package would. The run's ``hooks`` are empty: the package's hook
  scripts (Samba, CTDB) never run.
- **The FUSE client runs on the client's host**: ``nsenter --net=/run/netns/CLIENT
  glusterfs ... MOUNTPOINT`` changes the network namespace only, so the client's traffic
  crosses that host's link while the mount is the machine's, seen by what starts
  *later* with ``ip netns exec CLIENT`` (it copies the mount table; something started
  before sees it only if ``/`` is shared, and it is private on this VM: mount before
  starting engines). ``ip netns exec CLIENT mount`` would not do: that mount dies with
  the command's private mount namespace.
- **Every wait is bounded**, a failure quotes the log's tail, and
  :meth:`~GlusterVolume.close` leaves nothing (:func:`remove_stale`: nor a dead run).

Volume options: no ``performance.*`` is changed (:data:`OPTIONS` is empty). The ``fs``
tier writes a block into a temporary file (``O_EXCL``, ``O_DIRECT``: this mount takes
it), renames it (``os.replace``), and a reader checks the name (``access``) and
reads the file whole. Blocks are never rewritten, so quick-read, md-cache (1 s) and
open-behind cannot serve stale bytes. write-behind and flush-behind stay on: write-behind
queues a flush or a rename behind the inode's pending writes, so a name that is visible
has its bytes on the brick (``strict-o-direct`` is off: ``O_DIRECT`` writes are buffered
too). nl-cache stays off: with it a reader that looked a block up before it was written
could go on missing it. ``network.ping-timeout`` stays 42 s (a client of a cut-off server
hangs that long). ``options=`` sets others.

Measured here (2 cores, Debian 12, GlusterFS 10.3, brick on the root disk; hosts of
:mod:`p2pkv.bench.hosts`, veths on a bridge, MTU 1500, unshaped; ``dd bs=1M``, a 64 MiB
random file; medians of 3 runs of 7, single copies in brackets): written on one host
(``conv=fsync``) 280-330 MB/s (68-430), read on another 330-660 MB/s (295-840); 80 and
120 with vLLM loading the machine. The fs tier's pattern, 900 blocks of 768 KiB each
looked up (absent) on host B, written on A, read at once on B: all byte-exact (3 ms each).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from p2pkv.bench.netns import Unavailable as NetnsUnavailable

__all__ = ["OPTIONS", "PINNED", "GlusterError", "GlusterVolume", "Unavailable",
           "check_available", "remove_stale"]

#: What a volume needs on the machine.
TOOLS = ("glusterd", "gluster", "glusterfs", "nsenter", "ip", "mount", "umount")
#: glusterd's port on the server's host (its own namespace: no other glusterd there).
GLUSTERD_PORT = 24007
#: Directories compiled into GlusterFS 10.3 that no option moves; glusterd's mount
#: namespace has ``workdir/host/<key>`` bound over each.
PINNED = {"lib": "/var/lib/glusterd", "run": "/var/run/gluster", "log": "/var/log/glusterfs"}
#: Volume options set on every volume (see the module docstring: the defaults suit).
OPTIONS: dict[str, str] = {}
#: Seconds a ``gluster`` CLI call, a ``umount`` or a stop may take.
CLI_TIMEOUT = 30.0
#: The file in a workdir naming the process that owns the volume (pid, start time).
OWNER_FILE = "p2pkv-gluster.owner"
_GLUSTER_COMMS = frozenset({"glusterd", "glusterfsd", "glusterfs"})
#: mountinfo writes a space, tab, newline or backslash in a path as ``\\ooo``.
_OCTAL = re.compile(r"\\([0-7]{3})")
#: Unix socket paths are at most 107 bytes.
_SUN_PATH_MAX = 107


class Unavailable(NetnsUnavailable):
    """GlusterFS cannot run here (not root, a package or ``/dev/fuse`` missing); the
    message says why, so that a caller can skip with it."""


class GlusterError(RuntimeError):
    """A step of the volume failed; the message names it and quotes the log's tail."""


def check_available() -> None:
    """Raise :class:`Unavailable` with the reason when a volume cannot run here."""
    if os.geteuid() != 0:
        raise Unavailable("GlusterFS volumes need root (glusterd, FUSE mounts, namespaces)")
    missing = [t for t in TOOLS if shutil.which(t) is None
               and not os.access(f"/usr/sbin/{t}", os.X_OK)]
    if missing:
        raise Unavailable(f"not installed: {', '.join(missing)} (`make glusterfs` installs "
                          "Debian's glusterfs-server and glusterfs-client)")
    if not os.path.exists("/dev/fuse"):
        raise Unavailable("/dev/fuse is missing: the GlusterFS client mounts through FUSE")


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _run(argv: list[str], timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``argv`` with a deadline that holds even when the command is stuck in the kernel
    (a hung FUSE request): then it is left behind and this raises."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: left
            proc.communicate(timeout=2.0)
        raise GlusterError(f"{' '.join(argv)}: no answer in {timeout:.0f} s") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"({path}: {exc.strerror})"
    return f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this mount namespace (read from
    /proc/self/mountinfo: a ``stat`` could hang on a dead FUSE mount)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        points = {_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), line.split(" ", 5)[4])
                  for line in f}
    return str(path) in points


def _stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(name, the fields after it) of /proc/PID/stat, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 1:].split()


def _start_time(pid: int) -> str | None:
    """When ``pid`` started; None when it is gone or a zombie."""
    stat = _stat(pid)
    return None if stat is None or stat[1][0] == "Z" else stat[1][19]


def _processes(comms: frozenset[str]) -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of each live process (not a zombie) whose name is in ``comms``."""
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat is None or stat[0] not in comms or stat[1][0] == "Z":
            continue
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            yield int(entry), [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _stop_pids(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            pids = [p for p in pids if _start_time(p) is not None]
            if not pids:
                return
            time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM a child, SIGKILL it after ``grace`` seconds, reap it (bounded)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)


def _unmount(path: Path) -> str | None:
    """Unmount ``path`` (lazily when busy); what went wrong, or None."""
    err = ""
    for argv in (["umount", str(path)], ["umount", "-l", str(path)]):
        if not _mounted(path):
            return None
        try:
            err = _run(argv, timeout=15.0).stderr.strip()
        except GlusterError as exc:
            err = str(exc)
    return f"umount -l {path}: {err}" if _mounted(path) else None


def remove_stale() -> list[str]:
    """Unmount and stop what volumes of dead owners left (their owner was killed before
    :meth:`GlusterVolume.close`): every glusterd/glusterfsd/glusterfs whose command line
    names a path under a directory with an :data:`OWNER_FILE` whose process is gone.
    Returns what it removed. Nothing else is touched."""
    removed: list[str] = []
    for pid, argv in _processes(_GLUSTER_COMMS):
        root = _owner_root(argv)
        if root is None or _owner_alive(root):
            continue
        if argv and argv[0].endswith("glusterfs") and argv[-1].startswith("/"):
            _unmount(Path(argv[-1]))
        _stop_pids([pid], grace=2.0)
        removed.append(f"{pid} {' '.join(argv)}")
    return removed


def _owner_root(argv: list[str]) -> Path | None:
    paths = [a.split("=", 1)[-1] for a in argv]  # "--log-file=/x" and "/x" alike
    for path in (Path(p) for p in paths if p.startswith("/")):
        for parent in list(path.parents)[:-1][:6]:  # not "/" itself
            if (parent / OWNER_FILE).is_file():
                return parent
    return None


def _owner_alive(root: Path) -> bool:
    try:
        pid, started = (root / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return True  # unreadable: not provably dead, leave it
    return _start_time(int(pid)) == started


@dataclass
class _Mount:
    path: Path
    proc: subprocess.Popen[bytes]  # the FUSE client
    made_dir: bool  # mount() made the mount point (close() removes it)


class GlusterVolume:
    """One volume, ``name``, of one brick (``workdir/brick``), served by a glusterd of
    the run's own in network namespace ``server_netns`` at ``server_address``; mounted
    with :meth:`mount`. ``workdir`` must be new or empty of GlusterFS state; its
    ``log/`` outlives :meth:`close`. Raises :class:`Unavailable` where GlusterFS cannot
    run, :class:`GlusterError` when a step fails."""

    def __init__(self, server_netns: str, server_address: str, workdir: Path, *,
                 name: str = "kvcache", options: Mapping[str, str] | None = None,
                 start_timeout: float = 60.0) -> None:
        check_available()
        _check_netns(server_netns)
        self.server_netns = server_netns
        self.server_address = server_address
        self.name = name
        self.workdir = Path(workdir).resolve()
        self.log_dir = self.workdir / "log"
        self.brick = self.workdir / "brick"
        self._socket = self.workdir / "run" / "glusterd.socket"
        self._mounts: list[_Mount] = []
        self._glusterd: subprocess.Popen[bytes] | None = None
        self._created = self._started = self._closed = False
        if len(str(self._socket).encode()) > _SUN_PATH_MAX:
            raise GlusterError(f"workdir {self.workdir} is too long: glusterd's socket "
                               f"{self._socket} exceeds {_SUN_PATH_MAX} bytes")
        for d in ("state", "run", "host", "brick"):
            if (self.workdir / d).exists():
                raise GlusterError(f"{self.workdir / d} exists: give each volume a "
                                   "workdir of its own")
        remove_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        try:
            self._start_glusterd(start_timeout)
            self._create({**OPTIONS, **(options or {})}, start_timeout)
        except BaseException:
            self.close()
            raise

    # -- glusterd and the volume ---------------------------------------------------------

    def _start_glusterd(self, timeout: float) -> None:
        for d in ("state", "run", "log", "brick"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        binds: list[str] = []
        for key, target in PINNED.items():
            real = os.path.realpath(target)
            os.makedirs(real, exist_ok=True)  # the package's own, empty, if it is missing
            src = self.log_dir if key == "log" else self.workdir / "host" / key
            src.mkdir(parents=True, exist_ok=True)
            binds += [str(src), real]
        vol = self.workdir / "glusterd.vol"
        vol.write_text(_glusterd_vol(self.workdir, self._socket, self.server_address))
        out = self.log_dir / "glusterd.out"
        # sh binds each SRC over DST, then becomes glusterd: same pid, so nsenter --target
        # finds its mount namespace.
        script = ('while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 97; shift 2; '
                  'done; shift; exec "$@"')
        with open(out, "ab") as log:
            self._glusterd = subprocess.Popen(
                ["ip", "netns", "exec", self.server_netns, "sh", "-c", script, "sh", *binds,
                 "--", _tool("glusterd"), "-N", "-f", str(vol),
                 "-p", str(self.workdir / "run" / "glusterd.pid"),
                 "-l", str(self.log_dir / "glusterd.log")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            rc = self._glusterd.poll()
            if rc is not None:
                raise GlusterError(f"glusterd exited with {rc} in {self.server_netns}"
                                   f"{' (a bind mount failed)' if rc == 97 else ''}\n"
                                   f"{_tail(out)}\n{_tail(self.log_dir / 'glusterd.log')}")
            if self._socket.exists():
                done = self.gluster("pool", "list", timeout=10.0, check=False)
                if done.returncode == 0:
                    return
            if time.monotonic() > deadline:
                raise GlusterError(f"glusterd did not answer in {timeout:.0f} s\n"
                                   f"{_tail(self.log_dir / 'glusterd.log')}")
            time.sleep(0.1)

    def gluster(self, *args: str, timeout: float = CLI_TIMEOUT,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """``gluster ARGS`` against this run's glusterd, in its mount and network
        namespaces (see the module docstring); raises :class:`GlusterError` on failure
        when ``check``."""
        if self._glusterd is None or self._glusterd.poll() is not None:
            raise GlusterError(f"gluster {' '.join(args)}: glusterd is not running")
        done = _run(["nsenter", f"--target={self._glusterd.pid}", "--mount", "--net",
                     _tool("gluster"), "--mode=script", f"--glusterd-sock={self._socket}",
                     f"--log-file={self.log_dir / 'cli.log'}", *args], timeout=timeout)
        if check and done.returncode != 0:
            raise GlusterError(f"gluster {' '.join(args)} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()}\n"
                               f"{_tail(self.log_dir / 'glusterd.log')}")
        return done

    def _create(self, options: Mapping[str, str], timeout: float) -> None:
        # force: the brick is a directory of the root filesystem, which glusterd refuses
        # by default (it wants a filesystem of its own).
        self.gluster("volume", "create", self.name,
                     f"{self.server_address}:{self.brick}", "force")
        self._created = True
        for key, value in options.items():
            self.gluster("volume", "set", self.name, key, value)
        self.gluster("volume", "start", self.name)
        self._started = True
        deadline = time.monotonic() + timeout
        while not self._brick_online():
            if time.monotonic() > deadline:
                logs = sorted((self.log_dir / "bricks").glob("*.log"))
                raise GlusterError(f"the brick of {self.name} is not online after "
                                   f"{timeout:.0f} s\n"
                                   + "\n".join(_tail(p) for p in logs))
            time.sleep(0.1)

    def _brick_online(self) -> bool:
        done = self.gluster("volume", "status", self.name, "--xml", check=False)
        return done.returncode == 0 and "<status>1</status>" in done.stdout

    # -- mounts ----------------------------------------------------------------------------

    def mount(self, client_netns: str, mountpoint: Path, timeout: float = 30.0) -> Path:
        """Mount the volume at ``mountpoint`` (made if missing) with a FUSE client that
        runs in network namespace ``client_netns``; returns the mount point, which
        processes started later with ``ip netns exec CLIENT`` read and write."""
        _check_netns(client_netns)
        if self._glusterd is None or self._closed:
            raise GlusterError("mount: the volume is closed")
        path = Path(mountpoint).resolve()
        if _mounted(path):
            raise GlusterError(f"{path} is already a mount point")
        made = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"client-{len(self._mounts)}-{client_netns}.log"
        with open(self.log_dir / f"client-{len(self._mounts)}.out", "ab") as out:
            # -N: the client stays this process's child (stopped and reaped by close()).
            proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{client_netns}", _tool("glusterfs"), "-N",
                 "--process-name", "fuse", f"--volfile-server={self.server_address}",
                 f"--volfile-server-port={GLUSTERD_PORT}", f"--volfile-id={self.name}",
                 f"--log-file={log}", str(path)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        self._mounts.append(_Mount(path, proc, made))
        deadline = time.monotonic() + timeout
        while not _mounted(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (f"the client exited with {proc.returncode}" if proc.poll() is not None
                       else f"not mounted after {timeout:.0f} s")
                raise GlusterError(f"mount of {self.name} at {path} from {client_netns}: "
                                   f"{why}\n{_tail(log)}")
            time.sleep(0.05)
        # A lookup through the mount: the client has the volume and reaches the brick.
        probe = _run(["stat", "-c", "%i", str(path)], timeout=max(1.0, deadline -
                                                                time.monotonic()))
        if probe.returncode != 0:
            raise GlusterError(f"{path} is mounted but unusable: {probe.stderr.strip()}\n"
                               f"{_tail(log)}")
        return path

    def client_pids(self) -> dict[Path, int]:
        """The FUSE client process of each mount (its network namespace is the
        client's)."""
        return {m.path: m.proc.pid for m in self._mounts if m.proc.poll() is None}

    # -- teardown ----------------------------------------------------------------------------

    def processes(self) -> dict[int, list[str]]:
        """pid -> argv of every glusterd, brick and client of this volume that runs
        (found by the workdir their command lines name)."""
        return {pid: argv for pid, argv in _processes(_GLUSTER_COMMS)
                if any(f"{self.workdir}/" in arg for arg in argv)}

    def leftovers(self) -> list[str]:
        """What of this volume still runs or is mounted (empty after :meth:`close`)."""
        left = [f"mount {m.path}" for m in self._mounts if _mounted(m.path)]
        left += [f"process {pid}: {' '.join(argv)}" for pid, argv in self.processes().items()]
        return left

    def close(self) -> None:
        """Unmount, stop and delete the volume, stop every process of it, remove its
        state (``log/`` stays). Every step runs whatever failed before it; a Ctrl-C
        during one is re-raised after the rest. Raises :class:`GlusterError` only if
        something is still left. Safe to call twice and after a partial start."""
        notes: list[str] = []
        interrupted: BaseException | None = None
        for step in (self._close_mounts, self._close_volume, self._close_glusterd,
                     self._close_strays, self._close_state):
            try:
                note = step()
                if note:
                    notes.append(note)
            except (GlusterError, OSError, subprocess.SubprocessError) as exc:
                notes.append(f"{step.__name__}: {exc}")
            except BaseException as exc:  # Ctrl-C: finish tearing down first
                interrupted = interrupted or exc
        self._closed = True
        if interrupted is not None:
            raise interrupted
        left = self.leftovers()
        if left:
            raise GlusterError("after close, still there: " + "; ".join(left)
                               + ("\n" + "\n".join(notes) if notes else ""))

    def _close_mounts(self) -> str | None:
        notes = []
        for m in reversed(self._mounts):
            note = _unmount(m.path)
            if note:
                notes.append(note)
            _stop(m.proc, 5.0)  # a client does not leave on its own when unmounted
            if m.made_dir and not _mounted(m.path):
                with contextlib.suppress(OSError):
                    m.path.rmdir()
        return "; ".join(notes) or None

    def _close_volume(self) -> None:
        alive = self._glusterd is not None and self._glusterd.poll() is None
        if alive and self._started:
            self.gluster("volume", "stop", self.name)
            self._started = False
        if alive and self._created:
            self.gluster("volume", "delete", self.name)
            self._created = False

    def _close_glusterd(self) -> None:
        if self._glusterd is not None:
            _stop(self._glusterd, 10.0)

    def _close_strays(self) -> str | None:
        """The brick (if ``volume stop`` failed) and anything else naming the workdir."""
        pids = list(self.processes())
        _stop_pids(pids)
        return f"stopped strays {pids}" if pids else None

    def _close_state(self) -> None:
        for d in ("state", "run", "host", "brick"):
            shutil.rmtree(self.workdir / d, ignore_errors=True)
        for f in ("glusterd.vol", OWNER_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.workdir / f).unlink()

    def __enter__(self) -> GlusterVolume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_netns(name: str) -> None:
    if not os.path.exists(f"/run/netns/{name}"):
        raise GlusterError(f"no network namespace {name!r} (/run/netns/{name}): make it "
                           "with `ip netns add` first")


def _glusterd_vol(workdir: Path, socket: Path, address: str) -> str:
    """glusterd's volfile: the package's /etc/glusterfs/glusterd.vol with every state
    path in ``workdir`` and the listener on ``address`` only."""
    return f"""volume management
    type mgmt/glusterd
    option working-directory {workdir / 'state'}
    option run-directory {workdir / 'run'}
    option logging-directory {workdir / 'log'}
    option glusterd-sockfile {socket}
    option transport-type socket
    option transport.address-family inet
    option transport.socket.bind-address {address}
    option transport.socket.listen-port {GLUSTERD_PORT}
    option transport.socket.keepalive-time 10
    option transport.socket.keepalive-interval 2
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
"""
