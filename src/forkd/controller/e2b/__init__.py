"""E2B's API on a forkd daemon (``forkd serve --e2b-bind``): E2B's own SDKs, pointed at
it with ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``, create, list, pause
and kill ordinary forkd sandboxes, and read and write their files (docs/e2b.md).

One port serves E2B's REST API (:mod:`.rest`) and, at its root, what the SDKs send to
a sandbox's in-guest daemon, ``envd`` (:mod:`.envd`), which sandbox named by the
``E2b-Sandbox-Id`` header. Nothing here is a second engine: every call is the daemon's
own services'.
"""
