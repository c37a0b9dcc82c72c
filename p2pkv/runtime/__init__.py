"""The node's runtime: everything behind the :class:`~p2pkv.node.Node` facade.

Rooms, and what each holds (imports only go down this list, and never up into
``p2pkv.node``):

* ``public``: the value types the facade hands out (``NodeConfig``, ``PeerHandle``,
  ``FetchResult``, ``KeyOutcome``, ``NodeStats``).
* ``tuning``: the IO loop's tuning constants (the benchmark imports them).
* ``stats``: thread-safe counters behind ``Node.stats()``.
* ``state``: the IO thread's per-connection and per-request records.
* ``reactor``: the IO thread, its poller, wake-up pipe, command queue and deadline timer
  (threading model in its docstring).
* ``sender`` / ``receiver``: the data path, zero-copy sends with their release ledger,
  and ``recv_into`` landings with checksums and per-key outcomes.
* ``client`` / ``server``: the connections this node opens and the peers connected to
  its ROUTER; they turn session events into futures, answers and fetch jobs.

Protocol decisions (handshake verdicts, request states, credit and batching) are made by
the pure core in :mod:`p2pkv.protocol`; sockets come from :mod:`p2pkv.transport`.
"""
