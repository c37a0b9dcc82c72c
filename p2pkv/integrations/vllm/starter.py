"""The tier's p2pkv node: started once the engine's identity is fully known.

vLLM builds a tier before it seeds its block hashes, and the weights digest is computed
off the scheduler thread, so the node cannot start with the tier. :class:`TierNode`
starts it exactly once: from a thread of its own as soon as both are known
(:meth:`TierNode.start_early`), so that the engine's first request finds it running and
connected; or on first use, from whichever thread needs it first (the scheduler for a
lookup, the store thread for a store), if that comes sooner. Until then, and for good
when it cannot start, it answers None: the tier misses and fails its jobs, the engine
recomputes, nothing is shared under an identity that is not known. What the engine
computes meanwhile is announced once the node runs (``on_start``, see
:meth:`~p2pkv.integrations.vllm.computing.Computing.started`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from p2pkv.errors import P2PKVError
from p2pkv.identity import IdentityExtension, RunConfig
from p2pkv.integrations.vllm.directory import DirectorySource
from p2pkv.integrations.vllm.identity import (
    TierIdentity,
    VLLMKeyHash,
    current_key_hash,
    key_hash_ready,
)
from p2pkv.integrations.vllm.peers import Peers
from p2pkv.layout import EngineRowLayout
from p2pkv.node import Node, NodeConfig

log = logging.getLogger("vllm.p2pkv")

__all__ = ["EARLY_POLL", "REGISTER_WAIT", "TierNode"]

#: How often (seconds) the early start looks whether vLLM has seeded its block hashing.
EARLY_POLL = 0.05
#: Seconds ``on_start`` waits for the directory registration (with a directory): what
#: reaches the directory before it is dropped. A registration is a few Redis round trips;
#: one that takes longer (Redis unreachable) is not waited for, and ``on_start`` runs
#: then anyway, for the node and its static peers.
REGISTER_WAIT = 5.0


class TierNode:
    """The node (and directory) of one tier, and why it has not started when it has
    not. Attributes are read by the tier's threads; they are written under a lock."""

    def __init__(self, identity: TierIdentity, run_config: RunConfig,
                 layout: EngineRowLayout, config: NodeConfig, *, pool_blocks: int,
                 peers: Peers, identity_timeout: float, directory: str,
                 directory_options: dict[str, Any],
                 on_start: Callable[[], None] = lambda: None) -> None:
        self.identity = identity
        self._run_config = run_config
        self._layout = layout
        self._config = config
        self._pool_blocks = pool_blocks
        self._peers = peers
        self._identity_timeout = identity_timeout
        self._directory_url = directory
        self._directory_options = directory_options
        #: Called once the node runs (and, with a directory, is registered or
        #: :data:`REGISTER_WAIT` passed), from the thread that started it or, with a
        #: directory, a thread of its own; not after the tier closed.
        self._on_start = on_start
        #: Until when (``time.monotonic()``) the engine is starting: see
        #: :meth:`request_arrived`.
        self._starting_until = 0.0
        self._lock = threading.Lock()
        self._waiting_logged = False
        self.node: Node | None = None
        #: With a directory its cluster connects to the static peers (its fallback) and
        #: the tier's own peer list stays idle, unless the directory cannot be set up.
        self.directory: DirectorySource | None = None
        self.key_hash: VLLMKeyHash | None = None
        self.extension: IdentityExtension | None = None
        #: Why the node will never run (set once), or None.
        self.failed: str | None = None
        self.closed = False

    def settled(self) -> bool:
        """True once the node started, failed for good, or the tier closed."""
        return self.node is not None or self.failed is not None or self.closed

    def ensure(self, wait: float = 0.0) -> Node | None:
        """The node, started on first use once the identity is known; None while the
        weights digest is being computed (waiting up to ``wait`` seconds for it) and
        when the node cannot run."""
        if self.settled():
            return self.node
        try:
            known = self.identity.wait(wait)
        except Exception as exc:
            with self._lock:
                if self.failed is None:
                    self.failed = f"{type(exc).__name__}: {exc}"
                    log.error("p2pkv tier disabled: the weights digest could not be "
                              "computed (%s); nothing is shared", self.failed)
            return None
        if not known:
            if not self._waiting_logged:
                self._waiting_logged = True
                log.info("p2pkv tier: the weights digest is still being computed; until "
                         "it is known, lookups miss and stores wait (up to %.0f s)",
                         self._identity_timeout)
            return None
        # A start under way (early, or by another thread) is waited for: a request that
        # arrives meanwhile is asked once the node runs, as the first request always was.
        with self._lock:
            if self.settled():
                return self.node
            return self._start()

    def start_early(self, timeout: float) -> None:
        """Start the node from a thread of its own once the weights digest is known and
        vLLM has seeded its block hashing (:func:`key_hash_ready`), waiting at most
        ``timeout`` seconds for both; a lookup or store that comes first starts it
        instead (:meth:`ensure`), and one that comes during the start waits for it. Then
        it keeps connecting the static peers until each is connected, within the same
        ``timeout``, a peer never reached yet every half second. Ends early when the node
        cannot start or the tier closed."""
        deadline = self._starting_until = time.monotonic() + timeout

        def run() -> None:
            while not self.settled() and time.monotonic() < deadline:
                if key_hash_ready():
                    self.ensure(wait=min(EARLY_POLL * 10, max(0.0, deadline - time.monotonic())))
                else:
                    time.sleep(EARLY_POLL)
            # The static peers may start after this engine: keep trying them until each
            # is connected (the scheduler's steps take over once requests come).
            while self._peers_to_connect() and time.monotonic() < deadline:
                self.maintain(starting=True)
                time.sleep(EARLY_POLL * 10)

        threading.Thread(target=run, name="p2pkv-start", daemon=True).start()

    def request_arrived(self) -> None:
        """A request arrived: while the engine is starting (within the early start's
        ``timeout``), a static peer never reached yet is tried now, not at the early
        start's next half-second attempt. The request's lookups wait for a connection
        under way (up to their deadline, :meth:`Peers.ask`), so a peer that came up a
        moment ago answers the first request it can."""
        self.maintain(starting=time.monotonic() < self._starting_until)

    def _peers_to_connect(self) -> bool:
        """Whether the node runs on static peers (no directory) and one is not connected;
        read under the lock, so never in the middle of a start."""
        with self._lock:
            return (self.node is not None and not self.closed and self.directory is None
                    and not self._peers.all_connected())

    def _start(self) -> Node | None:
        try:
            # vLLM seeds its block hashes after building the scheduler (and the tier),
            # so the key hash is read here, once seeded (start_early waits for that).
            self.key_hash = current_key_hash()
            self.extension = self.identity.extension(self.key_hash)
            # Keys are vLLM's own (SPEC 15.2): the name says so, and the seed travels
            # only as the extension's digest, whose refusal says what to change.
            config = replace(self._config, key_hash_algo=self.key_hash.algo,
                             key_hash_seed=0)
            node = Node(self._run_config, self._layout, pool_blocks=self._pool_blocks,
                        config=config, extension=self.extension)
        except Exception as exc:  # reported once; the engine keeps running
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("p2pkv tier disabled, its node could not start: %s", self.failed)
            return None
        log.info("p2pkv tier node %s on %s: identity %s", node.node_id, node.address,
                 self.identity.describe())
        if self._directory_url != "static":
            ext = self.extension
            try:
                self.directory = DirectorySource(
                    node, self._directory_url,
                    extension="" if ext.is_empty else ext.digest, **self._directory_options)
            except Exception as exc:  # the static peers still work
                log.error("p2pkv tier: directory %s unusable (%s: %s); using the static "
                          "peers only", self._directory_url, type(exc).__name__, exc)
            else:
                log.info("p2pkv tier: directory %s, partition %s, registered as %s",
                         self._directory_url, self.directory.cluster.partition,
                         self.directory.cluster.address)
        # Visible last: whoever sees the node sees its directory too.
        self.node = node
        self.maintain()
        self._started()
        return node

    def _started(self) -> None:
        """Call ``on_start``: at once, or with a directory from a thread of its own once
        the node is registered there (a directory drops what comes before), at most
        :data:`REGISTER_WAIT` seconds later. An error in it is logged; the node runs."""
        def hand_over() -> None:
            if self.closed:
                return
            try:
                self._on_start()
            except Exception:  # a bug in what it announces must not stop the tier
                log.exception("p2pkv tier: announcing what the engine computed before its "
                              "node started failed")

        directory = self.directory
        if directory is None:
            hand_over()
            return

        def registered() -> None:
            directory.cluster.wait_registered(REGISTER_WAIT)
            hand_over()

        threading.Thread(target=registered, name="p2pkv-started", daemon=True).start()

    def maintain(self, *, starting: bool = False) -> None:
        """Keep the static peers connected (not needed with a directory); ``starting``:
        see :meth:`Peers.maintain`."""
        if self.node is not None and self.directory is None:
            self._peers.maintain(self.node, starting=starting)

    def close(self) -> None:
        """Withdraw this engine's claims from the directory, then drain the node (new
        fetches declined so consumers ask another holder, those in flight finish)."""
        # Under the lock: a node being started now (early, or by a straggling lookup)
        # is either seen here or, the tier closed, never started.
        with self._lock:
            self.closed = True
            node, directory = self.node, self.directory
        try:
            if directory is not None:
                try:
                    directory.close()
                except (P2PKVError, OSError) as exc:
                    log.warning("p2pkv tier: could not withdraw from directory %s (%s: %s); "
                                "its claims lapse with their TTL", self._directory_url,
                                type(exc).__name__, exc)
        finally:
            if node is not None:
                try:
                    node.drain()
                except P2PKVError as exc:
                    log.warning("p2pkv tier: the node did not drain cleanly (%s: %s)",
                                type(exc).__name__, exc)
