"""The data path of a connection: a fetching half chosen once per connection, and a
serving half chosen for each fetch as it arrives (a connection keeps a default one).

Blocks move one of four ways, each a *path* with a fetching half (on the connection this
node opened) and a serving half (on a peer connected to its ROUTER):

============  ==============================  =======================================
kind          serving half                    fetching half
============  ==============================  =======================================
``zmq``       :class:`FramesOut`: one frame   :class:`FramesIn`: ``recv_into`` each
              per segment, zero-copy, pinned  frame into its destination
              until libzmq lets go
``packed``    :class:`PackedOut`: a batch in  :class:`FramesIn` too: ``packed-v1`` is
              one frame (``packed-v1``)       a form of frames the sender picks per
                                              message (SPEC §17)
``shm``       ``SharedOut``: slots located    ``SharedIn``: copied from the peer's
              in the shared pool, pinned      mapped pool, then released
              until released (``shm-v1``)
``stream``    ``StreamOut``: gathered onto    ``StreamIn``: scattered from the stream
              the peer's bound data stream    straight into destinations
              (``tcp-data-v1``; under CURVE   (``Striped``: several streams, a
              sealed, ``tcp-data-aead-v1``,   fetch striped over them)
              or TLS, ``tcp-data-tls-v1``)
============  ==============================  =======================================

A connection asks its path, never which path it is on. The fetching half is chosen when
the connection becomes ready (:class:`~p2pkv.runtime.paths.choice.PathChoice`): shared
memory once the proof was accepted, else the data streams once bound, else frames. The
serving half of a fetch is chosen when the fetch arrives (its
:attr:`~p2pkv.runtime.paths.interfaces.Sending.path`): shared memory when the fetch asked for it
after an accepted proof, else the stream it names when that one is bound
(``tcp-streams-v1``), else the connection's path (its first bound stream; packed frames
when ``packed-v1`` was negotiated and the layout packs; frames).

Each half owns what differs between the ways: the credit budget (a stream gets a larger
one, SPEC §18.3), how a fetch opens, sending and landing, what a landing sends back, a
cancelled fetch's bytes, stalls, close, and the counts of what it moved
(:meth:`~p2pkv.runtime.stats.Counters.moved`, one shape for every path). Protocol errors
of the peer go back through the session's one door, as they did: a half raises the
:class:`~p2pkv.errors.ProtocolError` inside :meth:`~p2pkv.protocol.Session.receive_data`
(frames, shared memory), or hands it to its connection, which passes it to
:meth:`~p2pkv.protocol.Session.violated` (the stream's own bytes): either way the same
code, ``bye``, count and report.

The two halves' interfaces, and the job a serving half carries, are in
:mod:`p2pkv.runtime.paths.interfaces` (a leaf: it imports nothing of the runtime); the
ZeroMQ halves in :mod:`~p2pkv.runtime.paths.frames`, the others beside their machinery.

IO thread only.
"""
