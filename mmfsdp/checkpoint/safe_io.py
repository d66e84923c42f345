"""Safe reading: ``weights_only`` loading from any location, and values it accepts.

Files are read with ``torch.load(weights_only=True)``, a sharded directory's
``.metadata`` with an unpickler that knows only the classes DCP writes there
(:class:`SafeFileSystemReader`); what needs more loads only with
``allow_unsafe_checkpoints = True`` (:data:`UNSAFE_SWITCH`), with a warning.
This is the only module of the package that unpickles (``tests/unit/test_safe_io.py``
holds it); :func:`safe_reads` routes mmengine's and torch's own loaders here.
:func:`encode` stores numpy values and the message hub's log scalars as plain
values, so mmfsdp's own files need no switch and stock readers get the stock
values; :func:`decode` restores them exactly. See ``docs/checkpoints.md``.
"""
import contextlib
import contextvars
import errno
import io
import os
import pathlib
import pickle
import pickletools
import re
import stat
import types
import warnings
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..compat import (
    checkpoint_loader_replaced_by,
    dcp_metadata_path,
    dcp_metadata_private_globals,
    dcp_tensor_properties,
    load_whole_dcp,
)

__all__ = ['ENCODING_KEY', 'METADATA_GLOBALS', 'UNSAFE_SWITCH', 'IncompleteCheckpointError',
           'SafeFileSystemReader', 'UnsafeCheckpointError', 'decode', 'encode', 'load_file',
           'load_member', 'load_shards', 'read_all_shards', 'read_checkpoint', 'read_member',
           'safe_reads', 'unsafe_values', 'without_code']

#: The top-level config key that allows loading checkpoints that need arbitrary globals.
UNSAFE_SWITCH = 'allow_unsafe_checkpoints'
#: The top-level checkpoint key that records what :func:`encode` converted.
ENCODING_KEY = 'mmfsdp_encoding'

# Bound at import: safe_reads and read_checkpoint swap both for this module's readers.
_torch_load = torch.load
_mmengine_load = CheckpointLoader.load_checkpoint
#: The switch of the innermost :func:`safe_reads`: what :func:`read_checkpoint` defaults to.
_ALLOW_UNSAFE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    'mmfsdp_allow_unsafe_checkpoints', default=False)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs globals that ``weights_only`` loading does not allow."""


class IncompleteCheckpointError(OSError):
    """A shard file that a DCP ``.metadata`` names is missing or shorter than its entries."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f'{path} is incomplete: {reason}')
        #: What is wrong, without the path (``'its shard file X is missing'``).
        self.reason = reason


def load_file(file: Union[str, IO[bytes]], allow_unsafe: bool = False) -> Any:
    """``torch.load`` to the CPU with ``weights_only=True``, unless the user opted out.

    ``file`` is a path or a readable binary stream (as mmengine's remote
    backends hand over). Torch's legacy (non-zip) format is refused unless
    ``allow_unsafe``.
    """
    name = file if isinstance(file, str) else getattr(file, 'name', 'the checkpoint stream')
    if _is_legacy_format(file):
        if not allow_unsafe:
            raise UnsafeCheckpointError(
                f'{name} is in torch\'s legacy (non-zip) format (saved by torch < 1.6 or with '
                '_use_new_zipfile_serialization=False), which mmfsdp loads only with '
                'weights_only=False. Nothing from the file was executed. If you trust this file, '
                f'set `{UNSAFE_SWITCH} = True` in the config, or re-save it with a current torch.')
    else:
        try:
            # mmap: taking one shard of a large full checkpoint does not read the whole file
            return _torch_load(file, map_location='cpu', weights_only=True,
                               mmap=isinstance(file, str))
        except pickle.UnpicklingError as e:
            if not allow_unsafe:
                raise _refusal(name, 'safe loading (weights_only=True)', _rejected(e, file),
                               'to load it with weights_only=False') from None
    warnings.warn(f'Loading {name} with weights_only=False ({UNSAFE_SWITCH}=True): '
                  'unpickling can execute arbitrary code', stacklevel=2)
    if not isinstance(file, str):
        file.seek(0)
    return _torch_load(file, map_location='cpu', weights_only=False)


def _refusal(name: str, reader: str, reason: str, fallback: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f'{name} needs globals that {reader} rejects: {reason} Nothing from the file was '
        f'executed. If you trust this file, set `{UNSAFE_SWITCH} = True` in the config {fallback}.')


def _rejected(error: Exception, file: Union[str, IO[bytes]]) -> str:
    """What torch's ``weights_only`` unpickler rejected in ``file``, naming the globals.

    Its message names a global only for some instructions (not for a blocked
    module's ``os.system``, nor builtins by module), so the globals the file
    imports that torch does not allow are read statically (torch's
    ``get_unsafe_globals_in_checkpoint``: nothing runs); else the line of
    torch's message that says what stopped it, without its general advice.
    """
    if not isinstance(file, str):
        file.seek(0)  # the caller rewinds it again before any further read
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # noqa: BLE001 - an instruction its scan does not read (protocol >= 4)
        names = []
    if names:
        return f'{", ".join(names)}.'
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line.strip().startswith('Check the documentation')]
    line = lines[-1].split('WeightsUnpickler error:')[-1].split(' Please use ')[0].strip() \
        if lines else type(error).__name__
    operand = re.search(r'Unsupported operand (\d+)', line)  # e.g. protocol 4's FRAME
    opcode = pickletools.code2op.get(chr(int(operand[1]))) if operand else None
    return f'{line} (pickle instruction {opcode.name}).' if opcode else line


def _is_legacy_format(file: Union[str, IO[bytes]]) -> bool:
    if isinstance(file, str):
        with open(file, 'rb') as f:
            head = f.read(4)
    else:
        position = file.tell()
        head = file.read(4)
        file.seek(position)
    return head[:1] == b'\x80'  # pickle's PROTO opcode; zip archives start with b'PK'


def read_member(directory: Union[str, os.PathLike], name: str) -> bytes:
    """The bytes of ``name``, a regular file of the checkpoint directory ``directory``.

    A checkpoint directory's own files (``.metadata``, ``mmengine.pth``) are
    read only if they are regular files in it: opened without following a
    symbolic link and without blocking, checked with ``fstat``, and read up to
    the size they had when opened. A symbolic link (to another run's file, to
    ``/dev/zero``), a FIFO (whose open would wait for a writer) or a device
    raises :class:`UnsafeCheckpointError` naming the path and what it is;
    nothing is read from it. A missing file raises ``FileNotFoundError``.
    """
    path = os.path.join(os.fspath(directory), name)
    try:  # O_NONBLOCK: opening a FIFO for reading would wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ELOOP:  # ELOOP: O_NOFOLLOW met a symbolic link
            raise
        raise _not_regular(path, f'a symbolic link to {os.readlink(path)}') from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, _kind(info.st_mode))
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b''.join(chunks)
    finally:
        os.close(fd)


def load_member(directory: Union[str, os.PathLike], name: str, allow_unsafe: bool = False) -> Any:
    """:func:`load_file` of :func:`read_member` ``(directory, name)``."""
    stream = io.BytesIO(read_member(directory, name))
    stream.name = os.path.join(os.fspath(directory), name)  # for the messages
    return load_file(stream, allow_unsafe)


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, 'a FIFO'), (stat.S_ISCHR, 'a character device'),
             (stat.S_ISBLK, 'a block device'), (stat.S_ISSOCK, 'a socket'),
             (stat.S_ISDIR, 'a directory'))
    return next((what for test, what in kinds if test(mode)), 'not a regular file')


def _not_regular(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f'{path} is {what}; mmfsdp reads only files named in the checkpoint directory itself, '
        'and only regular files, as DCP and mmfsdp write them (whatever '
        'allow_unsafe_checkpoints says). Nothing was read from it; put the file itself there.')


def read_checkpoint(filename: str, allow_unsafe: Optional[bool] = None) -> Any:
    """The object saved at ``filename``: a local path or anything mmengine's loader reads.

    URLs, zoo prefixes and storage backends go through mmengine's
    ``CheckpointLoader`` (its download cache and barriers: every rank must
    call); only the unpickling is :func:`load_file`. A refused file raises on
    every rank, after mmengine's download barrier. ``allow_unsafe`` defaults
    to the switch of the enclosing :func:`safe_reads` (``False`` outside one).
    """
    allow_unsafe = _ALLOW_UNSAFE.get() if allow_unsafe is None else allow_unsafe
    if os.path.isfile(os.path.expanduser(filename)):
        return load_file(os.path.expanduser(filename), allow_unsafe)
    refused: List[UnsafeCheckpointError] = []

    def safe_load(f: Any, map_location: Any = None, **_: Any) -> Any:
        try:
            return load_file(f, allow_unsafe)
        except UnsafeCheckpointError as e:
            refused.append(e)
            return {}

    with _torch_load_replaced_by(safe_load):
        checkpoint = _mmengine_load(filename, map_location='cpu')
    if refused:
        raise refused[0]
    return checkpoint


@contextlib.contextmanager
def safe_reads(allow_unsafe: bool = False) -> Iterator[None]:
    """Inside, mmengine's and torch's loaders read through this module.

    mmengine's ``CheckpointLoader`` (``load_checkpoint``, ``init_cfg``
    ``Pretrained``, a backbone's own ``init_weights`` that calls either) is
    :func:`read_checkpoint`, with its URI schemes and download barrier;
    ``torch.load`` (and ``torch.hub`` under it) is :func:`load_file`. A
    refusal names :data:`UNSAFE_SWITCH`; ``allow_unsafe`` is its value.
    """
    def read(filename: str, map_location: Any = None, logger: Any = None) -> Any:
        return read_checkpoint(filename, allow_unsafe)

    def load(f: Any, map_location: Any = None, **_: Any) -> Any:
        return load_file(f, allow_unsafe)

    token = _ALLOW_UNSAFE.set(allow_unsafe)
    try:
        with checkpoint_loader_replaced_by(read), _torch_load_replaced_by(load):
            yield
    finally:
        _ALLOW_UNSAFE.reset(token)


@contextlib.contextmanager
def _torch_load_replaced_by(load: Callable[..., Any]) -> Iterator[None]:
    # mmengine's scheme loaders (and torch.hub under them) end in torch.load with torch's
    # defaults; route it to the safe loader.
    original = torch.load
    torch.load = load
    try:
        yield
    finally:
        torch.load = original


# ---- sharded directories: DCP's metadata and pickled entries ------------------------------


def _metadata_globals() -> Dict[Tuple[str, str], Any]:
    # What torch 2.13's FileSystemWriter pickles into .metadata (recorded from the globals its
    # unpickling looks up, for DCP saves of FSDP1, FSDP2, DDP, EMA and non-tensor entries).
    m = dcp_metadata
    objects = (m.Metadata, m.StorageMeta, m.MetadataIndex, m.TensorStorageMetadata,
               m.BytesStorageMetadata, m.ChunkStorageMetadata, m.TensorProperties, torch.Size,
               pathlib.PosixPath,  # StorageMeta.checkpoint_id
               *dcp_metadata_private_globals())
    allowed = {(o.__module__, o.__qualname__): o for o in objects}
    # a newer torch's TensorProperties (2.15 added strides) read as this torch's
    allowed[(m.TensorProperties.__module__, 'TensorProperties')] = dcp_tensor_properties()
    allowed[('pathlib', 'PosixPath')] = pathlib.PosixPath  # its name before Python 3.13
    # a dtype pickles as its name in torch ('torch', 'float32')
    allowed.update({('torch', d.__reduce__()): d for d in vars(torch).values()
                    if isinstance(d, torch.dtype)})
    return allowed


#: ``(module, name)`` of every global a DCP ``.metadata`` may name; anything else is refused.
METADATA_GLOBALS: Mapping[Tuple[str, str], Any] = types.MappingProxyType(_metadata_globals())


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle``'s unpickler that resolves only :data:`METADATA_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_GLOBALS.get((module, name))
        if found is None:
            raise _Rejected(f'Unsupported global: {module}.{name} is not a class of DCP '
                            'checkpoint metadata.')
        return found


class _Rejected(pickle.UnpicklingError):
    pass


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` that executes nothing and reads only the checkpoint directory.

    ``.metadata`` is unpickled with only :data:`METADATA_GLOBALS`; entries DCP
    stores pickled (non-tensor values) are read with ``weights_only=True``;
    shards are tensors, which torch reads with ``weights_only=True`` anyway.
    What these refuse raises :class:`UnsafeCheckpointError`, or, with
    ``allow_unsafe``, is read as torch's own reader does, with a warning.
    ``.metadata`` is read only as a regular file of the directory
    (:func:`read_member`). Each storage entry must name a regular file in the
    directory (a plain name, no symbolic link) and lie within its size; else,
    before any shard is opened, :class:`UnsafeCheckpointError` (whatever
    ``allow_unsafe``: DCP writes no other) or, for a missing or short file,
    :class:`IncompleteCheckpointError`; so does a ``.metadata`` whose chunks do
    not hold every tensor whole (:func:`_untiled`).
    """

    def __init__(self, path: Union[str, os.PathLike], allow_unsafe: bool = False) -> None:
        super().__init__(path)
        self.allow_unsafe = allow_unsafe
        #: The refusal raised last: DCP wraps errors (CheckpointException), it is raised again.
        self.refused: Optional[Exception] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """As ``FileSystemReader.read_metadata`` (a ``rank`` keyword reads the rank-local file)."""
        path = dcp_metadata_path(self, kwargs.get('rank'))
        data = read_member(self.path, os.path.basename(path))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except _Rejected as e:
            self._refuse(str(path), 'the DCP metadata reader', str(e), 'to read it with pickle')
            metadata = pickle.loads(data)  # noqa: S301 - allow_unsafe: the user trusts it
        self._check_storage(metadata)
        untiled = _untiled(metadata)
        if untiled is not None:
            self.refused = IncompleteCheckpointError(str(self.path), untiled)
            raise self.refused
        if getattr(metadata, 'storage_meta', None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's reader
        return metadata

    def _check_storage(self, metadata: Any) -> None:
        """Refuse entries outside the directory or past a file's end; nothing is opened."""
        root = os.path.realpath(self.path)
        ends: Dict[str, int] = {}
        for index, info in (getattr(metadata, 'storage_data', None) or {}).items():
            name, offset, length = (getattr(info, k, None)
                                    for k in ('relative_path', 'offset', 'length'))
            if not (isinstance(name, str) and name not in ('', '.', '..') and '\0' not in name
                    and name == os.path.basename(name) and type(offset) is type(length) is int
                    and min(offset, length) >= 0):
                self.refused = UnsafeCheckpointError(
                    f'{self.path}: its .metadata places {getattr(index, "fqn", index)!r} in '
                    f'{name!r} at offset {offset}, length {length}; mmfsdp reads only files '
                    'named in the checkpoint directory itself, as DCP writes them. Nothing was '
                    'read from it.')
                raise self.refused
            ends[name] = max(ends.get(name, 0), offset + length)
        for name, end in sorted(ends.items()):
            file = os.path.join(root, name)
            try:
                info = os.lstat(file)
            except FileNotFoundError:
                info = None
            if info is not None and not stat.S_ISREG(info.st_mode):
                self.refused = _not_regular(file, (
                    f'a symbolic link to {os.readlink(file)}' if stat.S_ISLNK(info.st_mode)
                    else _kind(info.st_mode)))
                raise self.refused
            if info is None or info.st_size < end:
                self.refused = IncompleteCheckpointError(str(self.path), (
                    f'its shard file {name} is missing' if info is None else
                    f'its shard file {name} is truncated ({info.st_size} < {end} bytes)'))
                raise self.refused

    def read_data(self, plan: Any, planner: Any) -> Any:
        """As ``FileSystemReader.read_data``; pickled entries are read with ``weights_only``."""
        return super().read_data(plan, _WeightsOnlyEntries(planner, self))

    def _refuse(self, name: str, reader: str, reason: str, fallback: str) -> None:
        """Raise the refusal, or with ``allow_unsafe`` warn and return."""
        if not self.allow_unsafe:
            self.refused = _refusal(name, reader, reason, fallback)
            raise self.refused from None
        warnings.warn(f'Reading {name} with the full unpickler ({UNSAFE_SWITCH}=True): '
                      'unpickling can execute arbitrary code', stacklevel=3)


def _untiled(metadata: Any) -> Optional[str]:
    """Why ``.metadata`` does not hold every tensor whole, in words; ``None`` if it does.

    Each tensor's chunks must lie within it, not overlap, add up to all of its
    elements and each have a storage entry (an empty one needs none), and each
    non-tensor entry must have one. A write whose ranks were not coordinated
    (each rank's DCP wrote its own ``.metadata`` into the same directory) holds
    one rank's chunks only.
    """
    storage = getattr(metadata, 'storage_data', None) or {}
    for fqn, entry in (getattr(metadata, 'state_dict_metadata', None) or {}).items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            if dcp_metadata.MetadataIndex(fqn) not in storage:
                return f'its .metadata stores nothing for {fqn!r}'
            continue
        size, covered = tuple(entry.size), 0
        for chunk in entry.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o < 0 or n < 0 or o + n > whole for o, n, whole in zip(offsets, sizes, size)):
                return (f'its .metadata places a chunk of {fqn!r} (offsets {list(offsets)}, '
                        f'sizes {list(sizes)}) outside the tensor ({list(size)})')
            if _volume(sizes) and dcp_metadata.MetadataIndex(fqn, offsets) not in storage:
                return f'its .metadata stores nothing for the chunk of {fqn!r} at {list(offsets)}'
            covered += _volume(sizes)
        if covered != _volume(size) or _overlapping(entry.chunks):
            return (f'its .metadata does not hold {fqn!r} whole: its chunks cover {covered} of '
                    f'its {_volume(size)} elements (a write whose ranks were not coordinated?)')
    return None


def _volume(sizes: Tuple[int, ...]) -> int:
    volume = 1
    for n in sizes:
        volume *= n
    return volume


def _overlapping(chunks: List[Any]) -> bool:
    """Whether two chunks share an element: a sweep along dimension 0 (FSDP shards along it)."""
    if not chunks or not tuple(chunks[0].sizes):
        return len(chunks) > 1  # a 0-d tensor: one chunk
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks if _volume(tuple(c.sizes)))
    active: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
    for offsets, sizes in boxes:
        active = [(o, n) for o, n in active if o[0] + n[0] > offsets[0]]
        for o, n in active:
            if all(a < b + m and b < a + k for a, k, b, m in zip(offsets, sizes, o, n)):
                return True
        active.append((offsets, sizes))
    return False


class _WeightsOnlyEntries:
    """A DCP load planner whose pickled entries are read with ``weights_only=True`` first."""

    def __init__(self, planner: Any, reader: SafeFileSystemReader) -> None:
        self._planner, self._reader = planner, reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            entry = _torch_load(value, map_location='cpu', weights_only=True)
        except pickle.UnpicklingError as e:
            self._reader._refuse(f'{self._reader.path} (entry {read_item.dest_index.fqn!r})',
                                 'safe loading (weights_only=True)', _rejected(e, value),
                                 'to load it with weights_only=False')
            value.seek(0)
            return self._planner.load_bytes(read_item, value)
        # torch's planner unpickles with weights_only=False: hand it a pickle of the safe value
        plain = io.BytesIO()
        torch.save(entry, plain)
        plain.seek(0)
        return self._planner.load_bytes(read_item, plain)


@contextlib.contextmanager
def _refusal_raised(reader: SafeFileSystemReader) -> Iterator[None]:
    """Raise the reader's refusal itself, not DCP's ``CheckpointException`` around it."""
    try:
        yield
    except (Exception, dcp.CheckpointException):  # DCP raises the latter, a BaseException
        if reader.refused is not None:
            raise reader.refused from None
        raise


def load_shards(state_dict: Dict[str, Any], path: str, allow_unsafe: bool = False) -> None:
    """``dcp.load(state_dict)`` from the directory ``path`` via :class:`SafeFileSystemReader`."""
    reader = SafeFileSystemReader(path, allow_unsafe)
    with _refusal_raised(reader):
        dcp.load(state_dict, storage_reader=reader)


def read_all_shards(path: str, allow_unsafe: bool = False) -> Dict[str, Any]:
    """Every entry of the DCP checkpoint ``path``, nested as saved, read in this process."""
    reader = SafeFileSystemReader(path, allow_unsafe)
    reader.read_metadata()  # a refusal here is raised as is, before DCP logs and wraps it
    with _refusal_raised(reader):
        return load_whole_dcp(reader)


# What a recorded path held: a numpy array, a numpy scalar, a HistoryBuffer.
_ARRAY, _SCALAR, _BUFFER = 'ndarray', 'numpy_scalar', 'history_buffer'
# Entries holding only tensors: nothing in them to encode or decode.
_TENSOR_ENTRIES = ('state_dict', 'optimizer')
# Tagged dicts of earlier mmfsdp versions.
_LEGACY_BUFFER, _LEGACY_NDARRAY = '__history_buffer__', '__ndarray__'
# Leaf types ``torch.load(weights_only=True)`` reads back.
_SAFE_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                torch.device, torch.Size)

Path = Tuple[Any, ...]


def encode(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with numpy values and ``HistoryBuffer`` objects as plain values.

    A numpy scalar becomes the Python number, an array a tensor of its dtype
    (a list if torch has none); the message hub's ``log_scalars`` move out of
    ``message_hub`` into the :data:`ENCODING_KEY` record, which also lists what
    was converted (the key is left out when nothing was).
    """
    plain: Dict[str, Any] = {}
    record: Dict[str, Any] = {}
    for entry, value in checkpoint.items():
        if entry in _TENSOR_ENTRIES:
            plain[entry] = value
            continue
        own: Dict[str, Any] = {}
        if entry == 'message_hub' and isinstance(value, Mapping) and value.get('log_scalars'):
            value, own['log_scalars'], own['resumed_keys'] = _split_message_hub(value)
        converted: Dict[Path, Tuple[str, str]] = {}
        plain[entry] = _plain(value, (), converted)
        if converted:
            own['converted'] = converted
        if own:
            record[entry] = own
    if record:
        plain[ENCODING_KEY] = record
    return plain


def decode(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`encode` (also of earlier versions' tagged dicts)."""
    record = checkpoint.get(ENCODING_KEY) or {}
    out: Dict[str, Any] = {}
    for entry, value in checkpoint.items():
        if entry == ENCODING_KEY:
            continue
        if entry in _TENSOR_ENTRIES:
            out[entry] = value
            continue
        own = record.get(entry, {})
        value = _restore(value, (), own.get('converted', {}))
        if 'log_scalars' in own:
            value = dict(value, log_scalars={k: _buffer(v) for k, v in own['log_scalars'].items()},
                         resumed_keys=dict(own['resumed_keys']))
        out[entry] = value
    return out


def _split_message_hub(state: Mapping[str, Any]) -> Tuple[dict, dict, dict]:
    """The message hub without its log scalars; the log scalars; all resumed keys."""
    scalars = state['log_scalars']
    resumed = dict(state.get('resumed_keys', {}))
    stock = dict(state, log_scalars={},
                 resumed_keys={k: v for k, v in resumed.items() if k not in scalars})
    return stock, {k: _buffer_plain(v) for k, v in scalars.items()}, resumed


def _buffer_plain(buffer: HistoryBuffer) -> Dict[str, Any]:
    history, counts = buffer.data
    return dict(log=_tensor(np.asarray(history)), count=_tensor(np.asarray(counts)),
                max_length=buffer.max_length)


def _buffer(value: Mapping[str, Any]) -> HistoryBuffer:
    return HistoryBuffer(_numpy(value['log']), _numpy(value['count']), value['max_length'])


def _tensor(array: np.ndarray) -> Any:
    """A tensor of the array's dtype and shape; a list if torch has no such dtype."""
    native = array.astype(array.dtype.newbyteorder('='), copy=False)
    try:
        return torch.from_numpy(np.ascontiguousarray(native).copy())
    except TypeError:  # strings, datetimes, ...: no tensor dtype
        return array.tolist()


def _numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(_untag(value))


def _plain(value: Any, path: Path, converted: Dict[Path, Tuple[str, str]]) -> Any:
    if isinstance(value, (torch.Tensor, torch.Size)):
        return value
    if isinstance(value, HistoryBuffer):
        converted[path] = (_BUFFER, '')
        return _buffer_plain(value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        converted[path] = (_ARRAY, value.dtype.str)
        return _tensor(value)
    if isinstance(value, np.generic):
        converted[path] = (_SCALAR, value.dtype.str)
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v, path + (k,), converted) for k, v in value.items()}
    if isinstance(value, set):  # elements are hashable: numpy scalars become Python's
        return {v.item() if isinstance(v, np.generic) else v for v in value}
    if isinstance(value, (list, tuple)):  # namedtuples become plain tuples
        items = [_plain(v, path + (i,), converted) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _restore(value: Any, path: Path, converted: Mapping[Path, Tuple[str, str]]) -> Any:
    kind = converted.get(path)
    if kind is not None:
        what, dtype = kind
        if what == _BUFFER:
            return _buffer(value)
        array = np.asarray(_numpy(value), dtype=np.dtype(dtype))
        return array[()] if what == _SCALAR else array
    if isinstance(value, Mapping):
        if value.get(_LEGACY_NDARRAY) is True or value.get(_LEGACY_BUFFER) is True:
            return _untag(value)
        return {k: _restore(v, path + (k,), converted) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, path + (i,), converted) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_restore(v, path + (i,), converted) for i, v in enumerate(value))
    return value


def _untag(value: Any) -> Any:
    """A value as earlier mmfsdp versions stored it (a tagged dict)."""
    if isinstance(value, Mapping) and value.get(_LEGACY_NDARRAY) is True:
        array = np.frombuffer(value['data'].numpy().tobytes(), dtype=np.dtype(value['dtype']))
        array = array.reshape(value['shape']).copy()
        return array[()] if value.get('scalar') else array
    if isinstance(value, Mapping) and value.get(_LEGACY_BUFFER) is True:
        return _buffer(value)
    return value


def without_code(state: Mapping[str, Any]) -> dict:
    """A scheduler's ``state_dict()`` without functions and bound methods.

    ``OneCycleParamScheduler`` stores ``anneal_func`` (a bound method); its
    constructor sets it again from the config, so leaving it out loses nothing.
    """
    code = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    return {k: v for k, v in state.items() if not isinstance(v, code)}


def unsafe_values(value: Any, path: str = 'checkpoint') -> Iterator[Tuple[str, type]]:
    """``(key path, type)`` of every value that ``weights_only`` loading would refuse."""
    if isinstance(value, _SAFE_LEAVES):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from unsafe_values(v, f'{path}[{k!r}]')
    elif isinstance(value, (list, tuple, set)):
        for i, v in enumerate(value):
            yield from unsafe_values(v, f'{path}[{i}]')
    else:
        yield path, type(value)
