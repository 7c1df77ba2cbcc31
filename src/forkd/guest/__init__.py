"""Guest side: image builder (kernel, initramfs, root image) and the in-guest agent."""
