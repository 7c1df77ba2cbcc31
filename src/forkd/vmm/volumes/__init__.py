"""Volumes: their disk images and layers, and mounting them in the guest."""
