"""The node's runtime: everything behind the :class:`~p2pkv.node.Node` facade.

Rooms, and what each holds (imports only go down this list, and never up into
``p2pkv.node``):

* ``public``: the value types the facade hands out (``NodeConfig``, ``PeerHandle``,
  ``FetchResult``, ``KeyOutcome``, ``NodeStats``).
* ``tuning``: the IO loop's tuning constants (the benchmark imports them).
* ``stats``: thread-safe, typed counters behind ``Node.stats()``.
* ``state``: the IO thread's per-request records and the fetch ticket.
* ``reactor``: the IO thread, its poller, wake-up pipe, command queue and deadline timer
  (threading model in its docstring).
* ``landing``: the one routine that settles a landed block (destination, checksum,
  commit or drop, per-key outcome), whichever way its bytes arrived.
* ``paths``: a connection's data path, a fetching half chosen once and a serving half
  per fetch (the two interfaces and the ZeroMQ halves); ``packing`` / ``sender`` /
  ``receiver`` / ``shm_server`` / ``shm_client`` / ``data_server`` / ``data_dial`` /
  ``data_client``: the machinery of each path (packed frames, zero-copy sends with their
  release ledger, ``recv_into`` landings, shared memory, the data streams) and its other
  halves; ``path_choice``: how an outbound connection comes to its path; ``lanes``: a
  fetch striped over several streams.
* ``outbound`` / ``inbound``: one connection each, owning its socket (or routing id),
  session, requests and data path; they turn session events into futures, answers and
  fetch jobs.
* ``client`` / ``server``: the registries of those connections and the reactor's hooks;
  ``wiring``: all of it put together for a node.

Protocol decisions (handshake verdicts, request states, credit and batching) are made by
the pure core in :mod:`p2pkv.protocol`; sockets come from :mod:`p2pkv.transport`.
"""
