"""The kernel an image boots: the ELF taken out of an xz-packed bzImage when it has a
PVH entry point (QEMU then skips the guest's own decompression), else the bzImage as
it is."""

from __future__ import annotations

import lzma
import struct
from pathlib import Path

import pytest

from forkd.guest import image as images
from forkd.guest import vmlinux

SETUP = b"MZ" + b"\0" * 510 + b"HdrS"  # stands for a bzImage's real-mode setup code


def note(name: bytes, kind: int, desc: bytes) -> bytes:
    pad = lambda b: b + b"\0" * (-len(b) % 4)  # noqa: E731
    return struct.pack("<III", len(name), len(desc), kind) + pad(name) + pad(desc)


def elf(notes: bytes) -> bytes:
    """A 64-bit little-endian ELF whose one program header is a PT_NOTE of ``notes``."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x20, 64)  # e_phoff
    struct.pack_into("<HH", header, 0x36, 56, 1)  # e_phentsize, e_phnum
    phdr = struct.pack("<IIQQQQQQ", vmlinux.PT_NOTE, 0, 120, 0, 0, len(notes), len(notes), 4)
    return bytes(header) + phdr + notes


PVH_ENTRY = note(b"Xen", vmlinux.XEN_ELFNOTE_PHYS32_ENTRY, b"\0" * 4)
PVH_ELF = elf(note(b"Xen", 6, b"linux\0") + PVH_ENTRY)


def bzimage(payload: bytes) -> bytes:
    return SETUP + lzma.compress(payload, format=lzma.FORMAT_XZ) + b"\0" * 64


def test_the_elf_with_a_pvh_entry_is_taken_out() -> None:
    assert vmlinux.unpacked_elf(bzimage(PVH_ELF)) == PVH_ELF


@pytest.mark.parametrize(
    "packed",
    [
        SETUP + b"\x04\x22\x4d\x18 an lz4 payload",  # the cloud kernel's: booted as it is
        bzimage(elf(note(b"Xen", 6, b"linux\0"))),  # no PVH entry: QEMU could not start it
        bzimage(b"not an ELF at all" * 10),
        SETUP + lzma.compress(PVH_ELF, format=lzma.FORMAT_XZ)[:-40],  # cut short
        bzimage(PVH_ELF[:80]),  # its program header runs past its end
    ],
)
def test_anything_else_boots_as_it_is(packed: bytes) -> None:
    assert vmlinux.unpacked_elf(packed) is None


def test_a_note_table_that_lies_about_its_sizes_ends_the_walk() -> None:
    lying = struct.pack("<III", 1 << 30, 1 << 30, vmlinux.XEN_ELFNOTE_PHYS32_ENTRY) + b"Xen\0"
    assert not vmlinux.has_pvh_entry(elf(lying))


def test_an_image_boots_the_elf_and_says_so(tmp_path: Path) -> None:
    packed = tmp_path / "vmlinuz"
    packed.write_bytes(bzimage(PVH_ELF))
    assert images._place_kernel(packed, tmp_path / "elf") == "elf-pvh"
    assert (tmp_path / "elf").read_bytes() == PVH_ELF
    packed.write_bytes(SETUP + b"lz4")
    assert images._place_kernel(packed, tmp_path / "as-is") == "bzimage"
    assert (tmp_path / "as-is").read_bytes() == SETUP + b"lz4"
