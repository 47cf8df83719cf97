"""Lazy safetensors inputs (header first, one key at a time) and an atomic, streaming safetensors writer for
the merge engine; architecture detection of a file.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import architectures, direct_write, partials

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
OUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype of outputs
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
MAX_HEADER_BYTES = 100 * 2**20
UNET_PREFIX = "model.diffusion_model."
WRITE_BACK_BYTES = 64 * 2**20  # appended bytes after which the writer starts writing them to disk
DIRECT_MIN_BYTES = 64 * 2**20  # outputs this large (fsynced) are written around the page cache
ALIGN = 64  # byte alignment of tensors in the spill file and of a written file's data
PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch zip, pickle


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, truncated, corrupt or of the wrong architecture."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}. {fix}")
        self.path, self.problem, self.fix = str(path), problem, fix


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: safetensors dtype name, shape and absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


class SafetensorsFile:
    """A safetensors file opened lazily: the header is parsed, tensors are read on demand.

    ``tensors`` maps each key to its ``TensorInfo``; ``arch`` and ``unet_only`` come from
    ``detect_architecture``. ``canonical(key)`` gives the whole-checkpoint name of a key (UNet-only
    files get the ``model.diffusion_model.`` prefix) so files of both layouts merge key by key.

    Opening a model reads only its header; tensors are read one key at a time: mapped (``map``: a private
    mapping of that key's bytes, read in place from the page cache, released with the tensor, so resident
    memory holds only the keys in flight) or read with ``os.preadv`` into buffers the caller owns. The
    architecture is detected from key names and shapes: a family of merge/architectures.py (``sd15``,
    ``sdxl``, ``flux``, ``flux2``, ``wan21``, ...; whole checkpoints or UNet/transformer-only files),
    ``lora-kohya``, ``lora-lycoris``, ``lora-peft`` or ``unknown``. Every problem with a file raises
    ``ModelFileError`` naming the file and what to do.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        self.arch, self.unet_only = detect_architecture(self.tensors)
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, arch={self.arch!r}, keys={len(self.tensors)})"

    def canonical(self, key: str) -> str:
        return UNET_PREFIX + key if self.unet_only else key

    def native(self, canonical_key: str) -> str:
        return canonical_key.removeprefix(UNET_PREFIX) if self.unet_only else canonical_key

    def canonical_keys(self) -> list[str]:
        return [self.canonical(k) for k in self.tensors]

    def fileno(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_into(self, key: str, buffer: torch.Tensor) -> torch.Tensor:
        """Read ``key`` (native name) into the front of ``buffer`` (uint8); return the typed view."""
        return self._read(key, self.tensors[key], buffer)

    def _read(self, key: str, info: TensorInfo, buffer: torch.Tensor) -> torch.Tensor:
        target = buffer[: info.nbytes]
        if info.nbytes:
            view = memoryview(target.numpy())
            got = os.preadv(self.fileno(), [view], info.start)
            while got < info.nbytes:  # short reads happen on some filesystems; finish them
                more = os.preadv(self.fileno(), [view[got:]], info.start + got)
                if more == 0:
                    raise ModelFileError(self.path, f"ends inside tensor {key!r}", "Fetch the file again.")
                got += more
        return target.view(info.torch_dtype).view(info.shape)

    def map(self, key: str, first: int | None = None, last: int | None = None) -> torch.Tensor:
        """``key`` (native name), or elements ``first:last`` of it flattened (a 1-D tensor), over a private
        mapping of the file: nothing is copied, the page cache is read in place. The pages are touched
        here, so the thread that maps them takes the page faults (and, if the file is not cached, the
        disk reads), not the one that computes. The mapping lives as long as the tensor; writing to
        it would change only this process's copy, never the file."""
        info = self.tensors[key]
        size = info.torch_dtype.itemsize
        shape = info.shape if first is None else (last - first,)
        start = info.start if first is None else info.start + first * size
        end = info.end if first is None else info.start + last * size
        if end == start:
            return torch.empty(shape, dtype=info.torch_dtype)
        if os.fstat(self.fileno()).st_size < end:
            raise ModelFileError(self.path, f"ends inside tensor {key!r} (it changed while it was read)",
                                 "Fetch the file again.")
        base = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self.fileno(), end - base, access=mmap.ACCESS_COPY, offset=base)
        data = torch.frombuffer(mapped, dtype=torch.uint8, count=end - start, offset=start - base)
        data[:: mmap.PAGESIZE].sum()  # fault every page in now
        return data.view(info.torch_dtype).view(shape)

    def read(self, key: str) -> torch.Tensor:
        """A freshly allocated copy of ``key`` (native name) in its stored dtype."""
        return self.read_into(key, torch.empty(self.tensors[key].nbytes, dtype=torch.uint8)).clone()


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: ``({key: TensorInfo}, metadata)``."""
    if not path.is_file():
        folder = "" if path.parent.is_dir() else f" (the folder {path.parent} does not exist)"
        raise ModelFileError(path, "no such file",
                             f"Check the path{folder}; relative model paths are looked up in the current "
                             "folder, then in the recipe's folder and --models-dir.")
    size = path.stat().st_size
    redo = "Re-download or re-save the file; it is not a valid .safetensors file."
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ModelFileError(path, f"only {size} bytes, too short for a safetensors header", redo)
        if prefix.startswith(PICKLE_MAGICS):
            raise ModelFileError(path, "is a pickle checkpoint (.ckpt/.pt), not safetensors; only "
                                       "safetensors files are read, since loading a pickle can run code",
                                 "Convert it once where you trust the file, e.g. python -c \"import torch, "
                                 "safetensors.torch as st; sd = torch.load('model.ckpt', weights_only=True); "
                                 "st.save_file(sd.get('state_dict', sd), 'model.safetensors')\", or use the "
                                 "model's .safetensors release.")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            problem = "truncated header" if length <= MAX_HEADER_BYTES else "corrupt header length"
            raise ModelFileError(path, f"{problem} ({length} bytes announced, file has {size})", redo)
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFileError(path, f"corrupt header ({error})", redo) from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "corrupt header (not a JSON object)", redo)
    metadata = header.pop("__metadata__", None) or {}
    base, tensors, data_end = 8 + length, {}, 0
    for key, entry in header.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            expected = DTYPES[dtype].itemsize * _prod(shape)
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(path, f"corrupt header entry for {key!r}: {entry!r}", redo) from None
        if not all(_natural(n) for n in (*shape, start, end)):
            raise ModelFileError(path, f"corrupt header entry for {key!r}: shape and offsets must be "
                                       f"non-negative integers, got {entry!r}", redo)
        if end - start != expected:
            problem = f"corrupt header: {key!r} spans {end - start} bytes, needs {expected}"
            raise ModelFileError(path, problem, redo)
        tensors[key] = TensorInfo(dtype, shape, base + start, base + end)
        data_end = max(data_end, end)
    if base + data_end > size:
        raise ModelFileError(path, f"truncated: {size} bytes, the header needs {base + data_end}",
                             "The download or copy was cut short; fetch the file again.")
    return tensors, dict(metadata)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prod(shape: Iterable[int]) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


# ---- architecture detection --------------------------------------------------------------------

_LYCORIS_MARKERS = (".hada_w1_a", ".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w2_a", ".hada_t1")
ARCHITECTURE_POLICIES = ("refuse", "allow")


def detect_architecture(tensors: Mapping[str, TensorInfo]) -> tuple[str, bool]:
    """``(arch, unet_only)`` from key names and shapes.

    LoRA files are ``lora-lycoris`` when any LoHa/LoKr tensor is present, ``lora-kohya`` for
    ``lora_down``/``lora_up`` and ``lora-peft`` for ``lora_A``/``lora_B`` (diffusers, BFL). Model files
    get the id of their family in merge/architectures.py's table (``sd15``, ``sdxl``, ``flux``,
    ``flux2``, ``wan21``, ...; ``unknown`` when none matches).
    """
    keys = tensors.keys()
    if any(k.endswith(_LYCORIS_MARKERS) for k in keys):
        return "lora-lycoris", False
    if any(k.endswith((".lora_down.weight", ".lora_up.weight")) for k in keys):
        return "lora-kohya", False
    if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
        return "lora-peft", False
    found = architectures.detect({k: info.shape for k, info in tensors.items()})
    return found.family, found.unet_only


def open_models(paths: Iterable[str | os.PathLike], architecture_policy: str = "refuse"
                ) -> list[SafetensorsFile]:
    """Open each path lazily and check that the weight files share one family and layout."""
    files = [SafetensorsFile(p) for p in paths]
    weights = [(f.path, f.arch, f.canonical_keys()) for f in files if not f.arch.startswith("lora")]
    check_same_architecture(weights, architecture_policy)
    return files


def check_same_architecture(models: list[tuple[str | os.PathLike, str, Iterable[str]]],
                            policy: str = "refuse") -> list[str]:
    """``(path or name, arch, canonical keys)`` of every weight input: a ``ModelFileError`` naming the
    first whose family or block layout differs from the first input's (``policy`` ``"refuse"``), or
    notes for the report: the mismatch (``"allow"``), inputs of no known family merged by key."""
    if not models:
        return []
    first_path, first, first_keys = models[0]
    first_layout = architectures.layout_of(first, first_keys)
    first_blocks = architectures.comparable_layout(first, first_keys)
    notes = []
    for path, arch, keys in models[1:]:
        keys = list(keys)
        if (arch, architectures.comparable_layout(arch, keys)) == (first, first_blocks):
            continue
        layout = architectures.layout_of(arch, keys)
        problem = f"is {_arch_phrase(arch)} but {Path(first_path).name} is " \
                  f"{first if first != 'unknown' else _arch_phrase(first)}: " \
                  f"{architectures.describe(arch, layout)} vs {architectures.describe(first, first_layout)}"
        if arch == first:
            problem += ", one family with different block counts"
        if policy != "allow":
            raise ModelFileError(
                path, problem,
                "Models of different architectures cannot be merged: use models of one base (one family "
                "with the same blocks: merge/architectures.py). To merge them key by key anyway, set "
                "architecture_policy 'allow' (the merge node's architecture_policy input, "
                "MergeOptions(architecture_policy='allow'), --architecture-policy allow)")
        notes.append(f"{Path(path).name} {problem}; merged key by key (architecture_policy 'allow')")
    if first == "unknown":
        notes.append(f"{Path(first_path).name} is of no known family (merge/architectures.py): merged key by "
                     f"key, without block names")
    return notes


def _arch_phrase(arch: str) -> str:
    if arch == "unknown":
        return "a model of unknown architecture (no keys of a known family)"
    return f"a {arch} model"


# ---- writer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputTensor:
    """One planned output tensor: name, torch dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * _prod(self.shape)


_Entry = tuple[str, torch.dtype, tuple[int, ...], int]  # key, dtype, shape, nbytes


class SafetensorsWriter:
    """Stream tensors into ``path`` through a temporary file; use as a context manager.

    The header is laid out up front from the plan (``outputs``: names, dtypes, shapes) and space is
    reserved for it, so tensors are written at their final offsets as they arrive, in plan order.
    A method may still drop a planned key or change a shape at run time (``pick_component``):
    offsets follow what was actually appended and the final header, padded with spaces to the
    reserved size, is written by ``commit()``, which then fsyncs and renames. Leaving the ``with``
    block by an exception (KeyboardInterrupt included) deletes the temporary file instead.

    The temporary file lies next to the output (``.<name>.<pid>-*.partial``: merge/partials.py removes
    those of killed merges). An output of ``DIRECT_MIN_BYTES`` or more that is to be fsynced has its data
    written around the page cache by merge/direct_write.py (its data section then starts at a 4 KiB
    boundary), the disk writing while the merge computes; where the filesystem refuses that, and for
    smaller files, every 64 MiB appended has its writeback to disk started without waiting. ``commit``
    refuses to replace an existing file unless ``overwrite``; ``abort`` deletes the temporary file and
    leaves everything else untouched.
    """

    def __init__(self, path: str | os.PathLike, outputs: list[OutputTensor], metadata: Mapping[str, str],
                 overwrite: bool = False, fsync: bool = True) -> None:
        self.path, self.overwrite, self.fsync = Path(path), overwrite, fsync
        self.metadata = dict(metadata)
        check_output_path(self.path, overwrite)
        planned = self._header_bytes([(o.key, o.dtype, o.shape, o.nbytes) for o in outputs], 0)
        self.data_start = 8 + len(planned) + 256 + 8 * len(outputs)  # slack for shapes that grow
        data_bytes = sum(o.nbytes for o in outputs)
        self.direct = fsync and direct_write.available() and data_bytes >= DIRECT_MIN_BYTES
        self.data_start += -self.data_start % (direct_write.BLOCK if self.direct else ALIGN)
        self.planned_size = self.data_start + data_bytes
        self.entries: list[_Entry] = []
        self.position = self._written_back = self.data_start
        self._fd: int | None = None
        self._direct: direct_write.DirectWriter | None = None
        self.temp_path: Path | None = None

    def _header_bytes(self, entries: list[_Entry], pad_to: int) -> bytes:
        header: dict = {"__metadata__": self.metadata} if self.metadata else {}
        offset = 0
        for key, dtype, shape, nbytes in entries:
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        return text + b" " * max(0, pad_to - len(text))

    def __enter__(self) -> SafetensorsWriter:
        partials.remove_stale(self.path)
        fd, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.{os.getpid()}-",
                                    suffix=".partial")
        self._fd, self.temp_path = fd, Path(name)
        try:
            os.ftruncate(fd, self.planned_size)
            if self.direct:
                try:
                    self._direct = direct_write.DirectWriter(self.temp_path, fd, self.data_start)
                except OSError:  # the filesystem has no O_DIRECT: written through the page cache
                    self.direct = False
        except BaseException:
            self.abort()
            raise
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or self._fd is not None:
            self.abort()

    def append(self, key: str, data: torch.Tensor) -> None:
        """Write the next tensor (contiguous, CPU) right after the previous one."""
        raw = data.reshape(-1).view(torch.uint8)
        if self._direct is not None:
            self._direct.append(raw)
        else:
            view = memoryview(raw.numpy())
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], self.position + done)
        self.entries.append((key, data.dtype, tuple(data.shape), raw.numel()))
        self.position += raw.numel()
        if self._direct is None and self.fsync and self.position - self._written_back >= WRITE_BACK_BYTES:
            self._write_back()

    def _write_back(self) -> None:
        """Start writing the bytes appended since the last call to disk, without waiting for them (the
        kernel's writeback of that range, POSIX_FADV_DONTNEED), so that ``commit``'s fsync finds
        little left to do; where posix_fadvise is missing, ``commit`` writes everything."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, self._written_back, self.position - self._written_back,
                             os.POSIX_FADV_DONTNEED)
        self._written_back = self.position

    def commit(self) -> Path:
        """Write the header, fsync and rename into place; returns the final path."""
        header = self._header_bytes(self.entries, self.data_start - 8)
        if len(header) != self.data_start - 8:
            raise RuntimeError(f"{self.path}: the final header outgrew its reserved space; report this bug")
        if self._direct is not None:
            self._direct.finish()
            self._direct.close()
            self.direct = self._direct.direct  # False where a write was refused and went buffered
        os.pwrite(self._fd, len(header).to_bytes(8, "little") + header, 0)
        os.ftruncate(self._fd, self.position)
        if self.fsync:
            os.fsync(self._fd)
        os.fchmod(self._fd, 0o644)
        os.close(self._fd)
        self._fd = None
        if self.overwrite:
            os.replace(self.temp_path, self.path)
        else:
            try:
                os.link(self.temp_path, self.path)  # atomic, and refuses to replace an existing file
            except FileExistsError:
                self.abort()
                message = f"{self.path} appeared during the merge; not replaced (pass overwrite)"
                raise FileExistsError(message) from None
            os.unlink(self.temp_path)
        self.temp_path = None
        if self.fsync:
            _fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file (idempotent)."""
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.temp_path is not None:
            self.temp_path.unlink(missing_ok=True)
            self.temp_path = None


def check_output_path(path: Path, overwrite: bool) -> None:
    """Fail early when ``path`` cannot be written: existing file without overwrite, missing folder."""
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; choose another name or pass overwrite=True (--overwrite)")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name ending in .safetensors")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the output folder {path.parent} does not exist; create it first")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None, overwrite: bool = False) -> Path:
    """Write a whole in-memory state dict atomically (small files: LoRA extraction, tests)."""
    items = list(tensors.items())
    outputs = [OutputTensor(k, t.dtype, tuple(t.shape)) for k, t in items]
    with SafetensorsWriter(path, outputs, metadata or {}, overwrite=overwrite) as writer:
        for key, tensor in items:
            writer.append(key, tensor.detach().cpu().contiguous())
        return writer.commit()
