"""The kernel a guest boots from: the ELF inside Debian's compressed ``vmlinuz``.

A bzImage carries its kernel compressed and undoes that itself at every
boot. Debian's generic kernel is compressed with xz, which a TCG guest takes
about four seconds to undo (the cloud kernel's lz4 took well under one). QEMU
can instead load the ELF ``vmlinux`` straight into guest memory and jump to
its PVH entry point, which x86 kernels built with ``CONFIG_PVH`` advertise in
an ELF note. Firecracker boots the same way. The ELF is larger on disk
(~65 MB against 8 MB); only a booting VM reads it, never a fork.
"""

from __future__ import annotations

import lzma
import struct

XZ_MAGIC = b"\xfd7zXZ\x00"
ELF_MAGIC = b"\x7fELF"
PT_NOTE = 4
XEN_ELFNOTE_PHYS32_ENTRY = 18  # the PVH entry point QEMU looks for
MAX_ELF_BYTES = 512 << 20  # a kernel is tens of MB: more is not a kernel


def unpacked_elf(bzimage: bytes) -> bytes | None:
    """The bootable ELF kernel inside ``bzimage``, or None where there is none to take.

    None when the payload is not xz (the image then boots as it is), or when
    what it holds is not a 64-bit ELF with a PVH entry point.
    """
    start = bzimage.find(XZ_MAGIC)
    if start < 0:
        return None
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        elf = decompressor.decompress(bzimage[start:], max_length=MAX_ELF_BYTES)
    except lzma.LZMAError:
        return None
    if not decompressor.eof or not has_pvh_entry(elf):
        return None
    return elf


def has_pvh_entry(elf: bytes) -> bool:
    """Whether ``elf`` is a 64-bit little-endian ELF whose notes name a PVH entry."""
    if len(elf) < 64 or elf[:4] != ELF_MAGIC or elf[4] != 2 or elf[5] != 1:
        return False
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + 56 > len(elf):
            return False
        p_type, _flags, offset, _vaddr, _paddr, filesz = struct.unpack_from("<IIQQQQ", elf, at)
        if p_type == PT_NOTE and _notes_name_pvh(elf[offset : offset + filesz]):
            return True
    return False


def _notes_name_pvh(notes: bytes) -> bool:
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, kind = struct.unpack_from("<III", notes, at)
        if at + 12 + _aligned(namesz) + descsz > len(notes):
            return False  # a note that runs past the table: not a kernel's
        name = notes[at + 12 : at + 12 + namesz].rstrip(b"\0")
        if name == b"Xen" and kind == XEN_ELFNOTE_PHYS32_ENTRY:
            return True
        at += 12 + _aligned(namesz) + _aligned(descsz)
    return False


def _aligned(size: int) -> int:
    return (size + 3) & ~3
