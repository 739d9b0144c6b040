"""A fingerprint of a model's weight files, compared at the hello (`LayoutDigest.model`'s `weights` factor).

Two instances whose configs agree but whose weights differ (two fine-tunes of one base, an old and a new
checkpoint, a base and an instruct model) compute blocks of the same shape with other values: exchanged, the
decode instance would answer as neither model does, without an error. Hashing every byte of a large model at
start-up would take minutes, so the fingerprint reads samples: each file's size, then `SAMPLE_BYTES` at evenly
spaced offsets, at least `MIN_SAMPLES` a file and one per `BYTES_PER_SAMPLE` (the first sample is the start of
the file, which for safetensors is its header: tensor names, shapes and dtypes). A fine-tune changes most
tensors, so some samples land in changed bytes; weights that differ in a few bytes only may share a fingerprint.
Copies of one model in other directories (or other hosts) have the same fingerprint: file names and times are
not hashed, only the weight files' order by name, their sizes and sampled bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SAMPLE_BYTES = 256
MIN_SAMPLES = 64
BYTES_PER_SAMPLE = 32 << 20
_INDEX = "model.safetensors.index.json"
_FALLBACK_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")


def weight_files(directory: Path) -> list[Path]:
    """The files that hold a model's weights, sorted by name: those its safetensors index names, else every
    `*.safetensors` file at its top level, else every `*.bin`, `*.pt`, `*.pth` and `*.gguf` file (files another
    format leaves beside the ones loaded, say a `consolidated.safetensors` no index names, are not counted)."""
    index = directory / _INDEX
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            named = set()
        files = [directory / name for name in named if isinstance(name, str) and (directory / name).is_file()]
        if files:
            return sorted(files)
    for suffixes in ((".safetensors",), _FALLBACK_SUFFIXES):
        files = [p for p in directory.iterdir() if p.suffix in suffixes and p.is_file()]
        if files:
            return sorted(files)
    return []


def sample_offsets(size: int) -> list[int]:
    """Where a file of `size` bytes is sampled: all of it for a small file, else evenly spaced reads from its start
    to its end."""
    count = max(MIN_SAMPLES, size // BYTES_PER_SAMPLE)
    if size <= count * SAMPLE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    step = (size - SAMPLE_BYTES) / (count - 1)
    return [round(i * step) for i in range(count)]


def fingerprint(location: str | Path) -> str:
    """16 hex digits for the weights in the directory `location`, or in the one file it names (a GGUF model is
    loaded from its file); "" where it holds no weight files."""
    path = Path(location)
    files = [path] if path.is_file() else weight_files(path)
    if not files:
        return ""
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            digest.update(size.to_bytes(8, "little"))
            for offset in sample_offsets(size):
                digest.update(os.pread(fd, SAMPLE_BYTES, offset))
        finally:
            os.close(fd)
    return digest.hexdigest()
