"""``forkd gateway``: one v1 API over many daemons, with no state of its own.

* :mod:`.nodes` knows the daemons (given, or found in DNS), polls each one's
  ``GET /v1/capacity`` and marks one that stops answering down;
* :mod:`.placement` picks the nodes for N children;
* :mod:`.proxy` forwards a request, or a WebSocket, to one node;
* :mod:`.routes` is the API: per-sandbox routes go to the node that owns the
  sandbox (its id's prefix is the node's id), lists are merged, and a fork
  on a node without the snapshot first moves it there through a registry.

Restarted, a gateway relearns everything from the nodes; two can run side by
side. See ``docs/scale-out.md``.
"""
