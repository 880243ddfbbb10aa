"""Files written and read in one pass, hashed on the way: safetensors files and the JSON of a
checkpoint, each fsync'd once, their SHA-256 computed while the bytes go out (a checkpoint's
manifest) and again while they come back in on a resume, so a save costs the disk's time, not
the disk's time plus a second read to hash, and a resume one read, not a read to hash and
another to load.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import queue
import re
import struct
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from glassloop.errors import CheckpointError
from glassloop.storage.atomic import NOFOLLOW, fsync_file, open_own
from glassloop.storage.serialization import sha256_of

CHUNK = 8 << 20  # bytes per write: large enough for disk speed, small enough to overlap


class Hasher:
    """SHA-256 in a thread of its own, fed chunks in file order: the caller reads or writes
    the next chunk while the last one is hashed (``hashlib`` and raw reads and writes release
    the GIL for buffers this large, so the two run on two cores)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.chunks: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=8)
        self.thread = threading.Thread(target=self._hash, name="glassloop-sha256", daemon=True)
        self.thread.start()

    def _hash(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            self.digest.update(chunk)

    def update(self, chunk: memoryview | bytes) -> None:
        self.chunks.put(chunk)  # (never changed afterwards: a tensor's or a file's bytes)

    def hexdigest(self) -> str:
        self.close()
        return self.digest.hexdigest()

    def close(self) -> None:
        if self.thread.is_alive():
            self.chunks.put(None)
            self.thread.join()


def write_digested(path: Path, pieces: Iterable[memoryview | bytes]) -> tuple[int, str]:
    """Write ``pieces`` into the new file ``path`` (never through a link), fsync it once and
    return its size and SHA-256, hashed while it is written (:class:`Hasher`), so a
    checkpoint costs its write, not its write plus a second pass to read it back (0.71 s
    instead of 1.06 s for 0.55 GB on a 2-core box: benchmarks/checkpoint.py). A large file
    goes past the page cache (:class:`DirectWriter`)."""
    views = [memoryview(piece).cast("B") for piece in pieces]
    size = sum(len(view) for view in views)
    hasher = Hasher()
    try:
        with open_own(path, "wb", buffering=0) as handle:
            out = DirectWriter(handle.fileno(), direct=size >= DIRECT_MIN)
            for view in views:
                for start in range(0, len(view), CHUNK):
                    hasher.update(view[start : start + CHUNK])
                    out.write(view[start : start + CHUNK])
            out.finish()
            digest = hasher.hexdigest()
            os.fsync(handle.fileno())
    finally:
        hasher.close()
    return size, digest


DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_MIN = 4 << 20  # a file smaller than this is written through the page cache
BLOCK = 4096  # O_DIRECT's unit: of the memory's address, the file's offset and the length


class DirectWriter:
    """Bytes written to the open file ``fd`` in order, past the page cache where the system
    allows it (``O_DIRECT``: through a page-aligned buffer, the last partial block without):
    on a 2-core VM, a 0.6 GB checkpoint (50 M parameters and Adam) took 1.2-1.6 CPU seconds
    through the page cache, most of it the kernel's, and 0.45 past it, SHA-256 included
    (1.4 s -> 0.46 s of wall time); that CPU time is what a background save took from the
    training steps beside it. Where ``O_DIRECT`` is refused (tmpfs, some network file
    systems), the bytes go through the page cache as before."""

    def __init__(self, fd: int, *, direct: bool) -> None:
        self.fd, self.filled = fd, 0
        self.direct = bool(DIRECT) and direct and self._set_direct(True)
        memory = mmap.mmap(-1, CHUNK)  # (page-aligned, as O_DIRECT needs)
        self.view, self.buffer = memoryview(memory), torch.frombuffer(memory, dtype=torch.uint8)

    def _set_direct(self, on: bool) -> bool:
        import fcntl

        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | DIRECT if on else flags & ~DIRECT)
        except OSError:  # (a file system without O_DIRECT)
            return False
        return on

    def write(self, view: memoryview) -> None:
        if not self.direct:
            if self.filled:  # (buffered before O_DIRECT was refused: those bytes come first)
                self.finish()
            self._write(view)
            return
        done = 0
        while done < len(view):
            take = min(CHUNK - self.filled, len(view) - done)
            into = slice(self.filled, self.filled + take)
            if view.readonly:  # (a header's bytes: small)
                self.view[into] = view[done : done + take]
            else:  # (a tensor's: torch's copy releases the GIL, the training goes on)
                source = torch.frombuffer(view[done : done + take], dtype=torch.uint8)
                self.buffer[into].copy_(source)
            self.filled, done = self.filled + take, done + take
            if self.filled == CHUNK:
                self.finish()

    def finish(self) -> None:
        """Write what the buffer holds (whole blocks past the page cache, a last partial one
        through it)."""
        whole = self.filled - self.filled % BLOCK if self.direct else self.filled
        self._write(self.view[:whole])
        if whole < self.filled:
            self.direct = self._set_direct(False)
            self._write(self.view[whole : self.filled])
        self.filled = 0

    def _write(self, chunk: memoryview) -> None:
        while chunk:  # (a raw write may take fewer bytes than it was given)
            try:
                written = os.write(self.fd, chunk)
            except OSError as err:
                if not self.direct or err.errno != errno.EINVAL:
                    raise
                self.direct = self._set_direct(False)  # (refused only when written)
                continue
            if self.direct and written % BLOCK:
                self.direct = self._set_direct(False)  # (the rest would be misaligned)
            chunk = chunk[written:]


def read_hashed(
    path: Path, header: dict[str, Any], *, copy: bool = True
) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the safetensors file ``path`` and the SHA-256 of its bytes, in one pass
    over them (the file mapped into memory, never through a link). ``header``: its header as
    :func:`glassloop.storage.weights.read_safetensors_header` checked it (the offsets are
    taken from the bytes hashed, and must agree with it). The caller compares the digest
    before it hands a tensor to anyone.

    ``copy``: each tensor in memory of its own, hashed from that copy as the next one is
    made (:class:`Hasher`), so the tensors are exactly the bytes hashed: a state that
    training goes on from (packed in one buffer at 4-byte offsets, a reduction sums in
    another order: an LBFGS resumed from them took a different step). Otherwise views of the
    mapped file, hashed as they are: weights that are copied into a model right away."""
    dtypes = [v["dtype"] for k, v in header.items() if k != "__metadata__"]
    if sys.byteorder != "little" or any(name not in NAMED_DTYPES for name in dtypes):
        tensors = {k: t.clone() for k, t in load_file(path).items()}  # (safetensors' own)
        return tensors, sha256_of(path)
    fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    try:  # (ACCESS_COPY: writable, privately, so torch never warns of a read-only buffer)
        data = memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)
    start = 8 + struct.unpack_from("<Q", data)[0]
    hasher, tensors = Hasher(), {}
    try:
        hasher.update(data if not copy else data[:start])
        tensors_at = _layout(path, data[8:start], header)
        if start + (tensors_at[-1][1][1] if tensors_at else 0) != len(data):
            raise CheckpointError(f"checkpoint: '{path}' changed while it was read")
        for name, (begin, end), dtype, shape in tensors_at:
            size, at = end - begin, start + begin
            if not size:
                tensors[name] = torch.empty(shape, dtype=dtype)
            elif not copy:
                count = size // dtype.itemsize
                tensors[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=at)
                tensors[name] = tensors[name].view(shape)
            else:  # (torch's copy releases the GIL, as the hash does)
                tensors[name] = torch.empty(shape, dtype=dtype)
                own = tensors[name].reshape(-1).view(torch.uint8)
                mapped = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=at)
                for part in range(0, size, CHUNK):
                    own[part : part + CHUNK].copy_(mapped[part : part + CHUNK])
                    hasher.update(_memory(own[part : part + CHUNK]))
        return tensors, hasher.hexdigest()
    finally:
        hasher.close()


def _layout(
    path: Path, raw: memoryview, header: dict[str, Any]
) -> list[tuple[str, tuple[int, int], torch.dtype, list[int]]]:
    """Each tensor's name, byte range, dtype and shape from the header's bytes, in file order,
    as ``header`` (the same bytes, checked by safetensors) has them: one after the other,
    each of its size."""
    changed = CheckpointError(f"checkpoint: '{path}' changed while it was read")
    try:
        stored = json.loads(bytes(raw))
        entries = sorted((v["data_offsets"], k) for k, v in stored.items() if k != "__metadata__")
        out, offset = [], 0
        for (begin, end), name in entries:
            dtype, shape = NAMED_DTYPES[stored[name]["dtype"]], stored[name]["shape"]
            size = math.prod(shape) * dtype.itemsize
            checked = header[name]["shape"], header[name]["dtype"], begin, end - begin
            if checked != (shape, stored[name]["dtype"], offset, size):
                raise changed
            out.append((name, (begin, end), dtype, shape))
            offset = end
    except (KeyError, TypeError, ValueError) as err:
        raise changed from err
    return out


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None
) -> tuple[int, str]:
    """Write ``tensors`` to the new safetensors file ``path``, fsync it, and return its size
    and SHA-256 (hashed while written: :func:`glassloop.storage.atomic.write_digested`).

    The bytes are exactly those of ``safetensors.torch.save_file`` with the metadata in
    sorted key order (a test compares them for every dtype), so every safetensors reader
    reads them and the same tensors and metadata always give the same bytes. Written here
    rather than by ``save_file`` because that one wrote at 0.34 GB/s where the disk takes
    1.4 GB/s (``benchmarks/checkpoint.py``) and cannot hash while it writes; reading stays
    with safetensors. A dtype this writer does not know goes through ``save_file``."""
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}
    if sys.byteorder != "little" or any(t.dtype not in DTYPE_NAMES for t in tensors.values()):
        return _save_file(tensors, path, metadata)
    # safetensors' order: by dtype, its enum's last first, then by name (bytes of UTF-8 sort
    # as code points do, so Python's str order is Rust's).
    names = sorted(tensors, key=lambda k: (-DTYPE_ORDER[tensors[k].dtype], k))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # (safetensors pads the header to 8 bytes with spaces)
    pieces: list[bytes | memoryview] = [struct.pack("<Q", len(raw)), raw]
    pieces += [_memory(tensors[name]) for name in names if tensors[name].numel()]
    return write_digested(path, pieces)


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    data: Any = tensor.reshape(-1).view(torch.uint8).numpy()  # (a buffer; numpy's stubs say no)
    return memoryview(data)


# The dtypes the writer knows, in the order of safetensors' ``Dtype`` enum (it sorts by it).
DTYPE_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.complex64: "C64",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
DTYPE_ORDER = {dtype: rank for rank, dtype in enumerate(DTYPE_NAMES)}
NAMED_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _save_file(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None
) -> tuple[int, str]:
    """``safetensors.torch.save_file``, its I/O failures (disk full, quota) raised as the
    ``OSError`` they are, the metadata sorted (:func:`_canonical_header`), the file fsync'd,
    its size and SHA-256 read back."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from err
    if metadata and len(metadata) > 1:
        _canonical_header(path)
    fsync_file(path)
    return path.stat().st_size, sha256_of(path)


def _canonical_header(path: Path) -> None:
    """Rewrite the header of a file safetensors just wrote with ``__metadata__`` sorted.

    safetensors keeps the metadata in a Rust ``HashMap``, whose order changes from process to
    process, so two identical saves differed in about half of all cases and ``sha256sum``
    could not tell users whether two models were the same. The header is JSON in serde's
    compact form; Python writes the same form (``ensure_ascii=False``), so the sorted header
    has the same length and is written back in place, padded with spaces as safetensors pads.
    """
    with path.open("rb+") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        ordered = {"__metadata__": header.pop("__metadata__"), **header}
        raw = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        assert len(raw) <= length, "serde and json write the same compact form"
        handle.seek(8)
        handle.write(raw + b" " * (length - len(raw)))
