"""The connections of a node's runtime: the one it opens to each peer (``outbound``),
each peer on its ROUTER (``inbound``), their registries and the reactor's hooks
(``client``, ``server``), and ``wiring``, which puts a node's runtime together.

A connection ties a session (:mod:`p2pkv.protocol`) to its socket and to a data path
(:mod:`p2pkv.runtime.paths`). IO thread only.
"""
