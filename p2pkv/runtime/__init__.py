"""The node's runtime: everything behind the :class:`~p2pkv.node.Node` facade.

Three layers, each importing only the ones below it (and never ``p2pkv.node``):

1. This package's own modules, what every part of the runtime shares:

   * ``config``: :class:`~p2pkv.runtime.config.NodeConfig` (no torch: the settings
     import it at once).
   * ``public``: the value types the facade hands out (``PeerHandle``, ``FetchResult``,
     ``KeyOutcome``, ``NodeStats``).
   * ``tuning``: the IO loop's tuning constants (the benchmark imports them).
   * ``pending``: pending-v1, the keys this node is computing and a peer's whole answer.
   * ``stats``: thread-safe, typed counters behind ``Node.stats()``.
   * ``state``: the IO thread's per-request records and the fetch ticket.
   * ``reactor``: the IO thread, its poller, wake-up pipe, command queue and deadline
     timer (threading model in its docstring).

2. :mod:`p2pkv.runtime.paths`, the data paths: how a block's bytes move, each path a
   fetching half chosen once per connection and a serving half chosen per fetch
   (``interfaces``: the two halves, a leaf), and their machinery: ``landing`` (the one
   routine that settles a landed block), ``frames`` / ``packing`` / ``sender`` /
   ``receiver`` (ZeroMQ frames, packed or not, zero-copy sends with their release
   ledger, ``recv_into`` landings), ``shm_server`` / ``shm_client`` (shared memory),
   ``data_server`` / ``data_sender`` / ``data_dial`` / ``data_client`` (the data
   streams); ``choice``: how an outbound connection comes to its path; ``lanes``: a
   fetch striped over several streams.

3. :mod:`p2pkv.runtime.connections`, the connections: ``outbound`` / ``inbound``, one
   connection each, owning its socket (or routing id), session, requests and data path,
   turning session events into futures, answers and fetch jobs; ``client`` / ``server``,
   their registries and the reactor's hooks; ``wiring``, all of it put together for a
   node.

Protocol decisions (handshake verdicts, request states, credit and batching) are made by
the pure core in :mod:`p2pkv.protocol`; sockets come from :mod:`p2pkv.transport`.
"""
