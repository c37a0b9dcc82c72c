"""The subcommands of ``p2pkv-node`` that run a node.

``serve`` (:mod:`~p2pkv.commands.serve`) runs one until a signal, and ``probe`` and
``fetch`` (:mod:`~p2pkv.commands.peer`) run a short-lived one that connects out to
another node; :mod:`~p2pkv.commands.common` holds the exit codes and the output they
share. The command line itself (the parser, the dispatch, the commands that start no
node of their own) is :mod:`p2pkv.cli`.
"""
