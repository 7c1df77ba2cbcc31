"""The egress proxy: every TCP connection a sandbox's guest opens, decided by name
(TLS SNI, HTTP Host) or address and sent on from the sandbox's own namespace
(docs/design/egress-proxy.md).

- :mod:`.sniff` reads the first bytes (a ClientHello, an HTTP request);
- :mod:`.resolver` finds where a name goes (pinned names, then the host's DNS);
- :mod:`.decide` says whether a name or an address may be reached;
- :mod:`.splice` moves bytes both ways with timeouts;
- :mod:`.http` serves plain HTTP one request at a time (each one's Host checked);
- :mod:`.records` keeps what each sandbox reached and was refused;
- :mod:`.proxy` listens inside each namespace and ties them together: each
  sandbox attached is an :mod:`.attachment` (its sockets, policy and open
  connections), each guest connection a :mod:`.connection`, served from its
  first bytes to its end.
"""
