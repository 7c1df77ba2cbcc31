"""Snapshots as OCI artifacts: push a snapshot to any OCI registry, pull it on another host.

* :mod:`.reference` parses ``registry/repository[:tag][@digest]``;
* :mod:`.policy` is the operator's word on which registries are reached and how
  (``--insecure-registry``, ``--default-registry``), and :mod:`.connect` holds
  every connection to it;
* :mod:`.auth` finds credentials (docker's ``config.json`` or a token) and
  answers the registry's challenges;
* :mod:`.registry` speaks the distribution API over httpx;
* :mod:`.artifact` is the wire format: the manifest, its config and layers;
* :mod:`.host_needs` records what a snapshot needs of a host and checks it;
* :mod:`.push` and :mod:`.pull` move one snapshot each way.

The layout is described in ``docs/design/oci-snapshots.md``.
"""
