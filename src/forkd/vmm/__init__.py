"""The VM driver: QEMU microVMs that boot, pause, snapshot, resume and fork."""
