"""Container images as forkd templates: fetch an OCI or Docker image from wherever it
lives, check it as the hostile input it is, and flatten its layers into a root image.

- ``model``: what an import produces (the image's config, its layer blobs);
- ``references`` / ``manifests`` / ``blob_store`` / ``fetch``: where an image comes
  from (a registry, a Docker Engine, ``docker save`` and OCI archives, an OCI
  layout), its manifests read within bounds, its blobs cached by digest;
- ``layers`` / ``tree`` / ``squash``: the layers read and merged (whiteouts, opaque
  directories, hard links) into one tree, written as a squashfs image without
  unpacking a byte of it onto the host.
"""
