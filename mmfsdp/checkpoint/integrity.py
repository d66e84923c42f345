"""Is a checkpoint complete? And, for auto-resume, the newest one that is.

Saves are atomic (:mod:`.durable`), but a file can still be cut short by a
full disk, a copy or a storage fault, and a shard of a sharded directory can
go missing. Auto-resume (``resume=True`` without ``load_from``) then falls
back to the newest earlier checkpoint that is complete, with a warning that
names both; a resume from a named checkpoint fails with the reason instead.

Checks read only metadata: the zip directory of a full file (``torch.save``
writes a zip archive whose directory is at its end, so a truncated file has
none), and for a sharded directory its meta file and every shard file listed
in the ``.metadata`` of ``torch.distributed.checkpoint``, with its size.
"""
import os
import re
import zipfile
from typing import Callable, Optional

from torch.distributed.checkpoint import FileSystemReader

__all__ = ['find_complete_checkpoint', 'incomplete_reason']


def _sharded_reason(path: str, meta_file: str) -> Optional[str]:
    if not os.path.isfile(os.path.join(path, meta_file)):
        return f'its {meta_file} is missing'
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata makes it incomplete
        return f'its .metadata cannot be read ({type(e).__name__}: {e})'
    needed = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f'its shard file {name} is missing'
        if os.path.getsize(file) < size:
            return f'its shard file {name} is truncated ({os.path.getsize(file)} < {size} bytes)'
    return _file_reason(os.path.join(path, meta_file))


def _file_reason(path: str) -> Optional[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        return f'it is truncated or not a torch.save archive ({e})'
    return None


def incomplete_reason(path: str, meta_file: str) -> Optional[str]:
    """Why the checkpoint at ``path`` (file or sharded directory) is incomplete, or ``None``."""
    if os.path.isdir(path):
        return _sharded_reason(path, meta_file)
    if not os.path.isfile(path):
        return 'it does not exist'
    return _file_reason(path)


def find_complete_checkpoint(path: str, meta_file: str,
                             warn: Callable[[str], None]) -> str:
    """``path`` if complete, else the newest complete earlier checkpoint beside it.

    Earlier means the same file name with a smaller number (``iter_6.pth`` ->
    ``iter_4.pth``, ``iter_2.pth``). Raises ``FileNotFoundError`` naming
    ``path`` and its defect when there is none.
    """
    reason = incomplete_reason(path, meta_file)
    if reason is None:
        return path
    directory, name = os.path.split(path)
    match = re.fullmatch(r'(.*?)(\d+)(\D*)', name)
    candidates: list = []
    if match is not None and os.path.isdir(directory):
        prefix, step, suffix = match.group(1), int(match.group(2)), match.group(3)
        pattern = re.compile(re.escape(prefix) + r'(\d+)' + re.escape(suffix))
        candidates = sorted(((int(m.group(1)), n) for n in os.listdir(directory)
                             if (m := pattern.fullmatch(n)) and int(m.group(1)) < step),
                            reverse=True)
    for _, candidate in candidates:
        earlier = os.path.join(directory, candidate)
        if incomplete_reason(earlier, meta_file) is None:
            warn(f'Auto-resume: the latest checkpoint {path} is incomplete ({reason}); '
                 f'resuming from {earlier}, the newest complete one before it')
            return earlier
    raise FileNotFoundError(
        f'Auto-resume: the latest checkpoint {path} is incomplete ({reason}) and no complete '
        f'earlier checkpoint is in {directory or "."}; restore it, or set resume=False to '
        'start over')

