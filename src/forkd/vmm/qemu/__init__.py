"""QEMU itself: its command line, how it is started (and undone when a start
fails), its QMP channel, and finding forkd's QEMU processes on the host."""
