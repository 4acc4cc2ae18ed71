#!/usr/bin/env python3
"""Lists the GPU code embedded in ELF binaries: one line per fatbin entry,
"<binary> ELF sm_90" (SASS, runs as is) or "<binary> PTX sm_90" (compiled by
the driver at load). What `cuobjdump --list-elf --list-ptx` reports, for
machines whose CUDA toolkit has no cuobjdump (the pip-installed nvcc).

Reads the .nv_fatbin sections: containers of a 16-byte header (magic
0xBA55ED50, version 1, header size, payload size) followed by entries whose
header gives kind (1 = PTX, 2 = ELF), header size, payload size and the SM
architecture.

usage: fatbin_archs.py BINARY... ; exit 1 when a binary has no fatbin.
"""
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "ELF", 0x10: "ELF"}


def sections(data):
    """Yields (name, bytes) of an ELF64 little-endian file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
               for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    for name_off, kind, _, _, offset, size, *_ in headers:
        name = names[name_off:names.index(b"\0", name_off)].decode()
        if kind != 8:  # SHT_NOBITS has no bytes in the file
            yield name, data[offset:offset + size]


def entries(fatbin):
    """Yields (kind, sm) of every entry of every container in a section."""
    pos = 0
    while pos + 16 <= len(fatbin):
        magic, version, header_size, size = struct.unpack_from(
            "<IHHQ", fatbin, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; skip padding
            continue
        if version != 1 or header_size != 16:
            raise ValueError(f"unknown fatbin container version {version}")
        entry, end = pos + header_size, pos + header_size + size
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from(
                "<HHIQ", fatbin, entry)
            if entry_header == 0:
                break
            sm, = struct.unpack_from("<I", fatbin, entry + 28)
            yield KINDS.get(kind, f"kind{kind}"), sm
            entry += entry_header + payload
        pos = end


def main(paths):
    status = 0
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        found = [entry for name, body in sections(data)
                 if name == ".nv_fatbin" for entry in entries(body)]
        if not found:
            print(f"{path}: no GPU code (.nv_fatbin)", file=sys.stderr)
            status = 1
        for kind, sm in sorted(set(found)):
            print(f"{path} {kind} sm_{sm}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
