"""The host's side of the guest agent: the channel, its line protocol, the
guest operations built on it, and guest ports reached through it."""
