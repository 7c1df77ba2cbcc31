"""What keeps a VM in: its cgroup, its network namespace and egress policy, the
uid its QEMU drops to, and the confined unpacking of a client's archives."""
