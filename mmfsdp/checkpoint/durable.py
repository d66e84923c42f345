"""Durable writing: crash-safe saves, clean-up of this run's leftovers, completeness checks.

Every write goes to ``<token>-NAME.tmp``, is ``fsync``-ed, renamed onto
``NAME`` (a directory there is first renamed aside), and the parent directory
is ``fsync``-ed: a crash leaves at most temporaries, never a partial ``NAME``.
The token names one run's temporaries, so clean-up deletes only what this run
(or the run it resumed) wrote. See ``docs/checkpoints.md``.
"""
import io
import os
import re
import shutil
import uuid
import zipfile
from typing import IO, Any, Callable, Iterable, List, Optional, Sequence, Union

import torch

from .safe_io import (
    IncompleteCheckpointError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    read_member,
)

__all__ = ['find_complete_checkpoint', 'incomplete_reason', 'new_token', 'publish_unpublished',
           'remove_path',
           'remove_stale_temporaries', 'replace_path', 'save_atomically', 'temporary_path',
           'write_text_atomically']

TMP_SUFFIX = '.tmp'
#: A directory checkpoint being replaced (a ``.tmp`` too, for the clean-up).
OLD_SUFFIX = '.old' + TMP_SUFFIX


def new_token() -> str:
    """A token that names one run's temporaries (``run`` and 8 random hex digits)."""
    return f'run{uuid.uuid4().hex[:8]}'


def temporary_path(path: str, token: str = '', suffix: str = TMP_SUFFIX) -> str:
    """``<token>-NAME.tmp`` beside ``path``; without a token ``NAME.tmp`` (never cleaned up)."""
    head, name = os.path.split(path.rstrip(os.sep))
    return os.path.join(head, f'{token}-{name}{suffix}' if token else f'{name}{suffix}')


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    if not os.path.isdir(path):
        _fsync(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def remove_path(path: str) -> None:
    """Delete a file or directory tree, if there is one."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def replace_path(src: str, dst: str, token: str = '') -> None:
    """Durably rename ``src`` (file or directory) onto ``dst``, replacing it.

    A directory at ``dst`` is first renamed aside to ``<token>-NAME.old.tmp``:
    two renames, so there is never a moment with half a directory.
    """
    _fsync_tree(src)
    if os.path.isdir(dst) and not os.path.islink(dst):
        aside = temporary_path(dst, token, OLD_SUFFIX)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.replace(dst, aside)
        os.replace(src, dst)
        _fsync(_parent(dst))
        shutil.rmtree(aside)
    else:
        os.replace(src, dst)
    _fsync(_parent(dst))


def save_atomically(obj: Any, path: str, token: str = '') -> None:
    """``torch.save`` to :func:`temporary_path`, ``fsync``, then rename onto ``path``."""
    os.makedirs(_parent(path), exist_ok=True)
    tmp = temporary_path(path, token)
    torch.save(obj, tmp)
    replace_path(tmp, path, token)


def write_text_atomically(text: str, path: str) -> None:
    """Write a small text file (a pointer such as ``last_checkpoint``) durably."""
    tmp = temporary_path(path)
    with open(tmp, 'w') as f:
        f.write(text)
    replace_path(tmp, path)


def remove_stale_temporaries(directory: str, tokens: Iterable[str]) -> List[str]:
    """Delete the ``<token>-*.tmp`` entries of ``tokens`` in ``directory``; return their names.

    A ``<token>-NAME.old.tmp`` whose ``NAME`` is gone (a crash between the two
    renames of :func:`replace_path`) is renamed back instead. Call it only
    after a completed save, when none of these runs is writing there.
    """
    prefixes = tuple(f'{token}-' for token in tokens if token)
    removed: List[str] = []
    if not prefixes or not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        if not (name.startswith(prefixes) and name.endswith(TMP_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        if name.endswith(OLD_SUFFIX):
            final = os.path.join(directory, name.split('-', 1)[1][:-len(OLD_SUFFIX)])
            if not os.path.lexists(final):
                os.replace(path, final)
                continue
        remove_path(path)
        removed.append(name)
    if removed:
        _fsync(directory)
    return removed


def incomplete_reason(path: str, meta_file: str, allow_unsafe: bool = False) -> Optional[str]:
    """Why the file or sharded directory ``path`` is incomplete (read from metadata), or None.

    A ``.metadata`` that safe reading refuses raises :class:`UnsafeCheckpointError`.
    """
    if not os.path.isdir(path):
        return 'it does not exist' if not os.path.isfile(path) else _zip_reason(path)
    if not os.path.lexists(os.path.join(path, meta_file)):
        return f'its {meta_file} is missing'
    try:  # the reader checks that every shard file is there and long enough
        SafeFileSystemReader(path, allow_unsafe).read_metadata()
    except UnsafeCheckpointError:
        raise  # not incomplete: the user must hear why, and may opt in
    except IncompleteCheckpointError as e:
        return e.reason
    except Exception as e:  # noqa: BLE001 - any unreadable metadata makes it incomplete
        return f'its .metadata cannot be read ({type(e).__name__}: {e})'
    # a regular file of the directory only (else UnsafeCheckpointError), read within its size
    return _zip_reason(io.BytesIO(read_member(path, meta_file)))


def _zip_reason(file: Union[str, IO[bytes]]) -> Optional[str]:
    # torch.save writes a zip archive whose directory is at its end: a cut file has none
    try:
        with zipfile.ZipFile(file) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        return f'it is truncated or not a torch.save archive ({e})'
    return None


def find_complete_checkpoint(path: str, meta_file: str, warn: Callable[[str], None],
                             allow_unsafe: bool = False) -> str:
    """``path`` if complete, else the newest complete earlier checkpoint beside it (a warning).

    Earlier means the same name with a smaller number (``iter_6.pth`` ->
    ``iter_4.pth``). Raises ``FileNotFoundError`` naming ``path`` and its
    defect when there is none.
    """
    reason = incomplete_reason(path, meta_file, allow_unsafe)
    if reason is None:
        return path
    directory, name = os.path.split(path)
    family = _family(name)
    candidates: list = []
    if family is not None and os.path.isdir(directory):
        step = int(family.fullmatch(name).group(1))
        candidates = sorted(((int(m.group(1)), n) for n in os.listdir(directory)
                             if (m := family.fullmatch(n)) and int(m.group(1)) < step),
                            reverse=True)
    for _, candidate in candidates:
        earlier = os.path.join(directory, candidate)
        if incomplete_reason(earlier, meta_file, allow_unsafe) is None:
            warn(f'Auto-resume: the latest checkpoint {path} is incomplete ({reason}); '
                 f'resuming from {earlier}, the newest complete one before it')
            return earlier
    raise FileNotFoundError(
        f'Auto-resume: the latest checkpoint {path} is incomplete ({reason}) and no complete '
        f'earlier checkpoint is in {directory or "."}; restore it, or set resume=False to '
        'start over')


def _family(name: str) -> Optional[re.Pattern]:
    """The names of ``name``'s checkpoints at other steps (``iter_4.pth``: ``iter_<N>.pth``)."""
    match = re.fullmatch(r'(.*?)(\d+)(\D*)', name)
    return match and re.compile(re.escape(match.group(1)) + r'(\d+)' + re.escape(match.group(3)))


def publish_unpublished(work_dir: str, meta_file: str,
                        lineage: Callable[[str], Sequence[str]],
                        allow_unsafe: bool = False) -> Optional[str]:
    """Publish the newest checkpoint a killed run wrote completely but had not yet renamed.

    A run killed after its background write ended on every rank, before it
    renamed the write into place, leaves a complete ``<token>-NAME.tmp``.
    Auto-resume calls this (rank 0) first. Only the lineage of the checkpoint
    ``last_checkpoint`` names may continue: ``lineage(path)`` gives its tokens
    (the run that wrote it and the runs it resumed from), and only their
    temporaries count, so another run's leftovers in the same work dir (a run
    started there with ``resume=False``) are never published. Of those, the
    newest complete one of a later step is renamed into place and
    ``last_checkpoint`` repointed. Without ``last_checkpoint`` no lineage is
    known and nothing is published. Returns its path, or ``None``.
    """
    pointer = os.path.join(work_dir, 'last_checkpoint')
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        latest = f.read().strip()
    directory, family = os.path.dirname(latest), _family(os.path.basename(latest))
    if family is None or not os.path.isdir(directory):
        return None
    newer_than = int(family.fullmatch(os.path.basename(latest)).group(1))
    tokens = set(lineage(latest))
    found = []
    for name in os.listdir(directory):
        run = re.fullmatch(r'(run[0-9a-f]{8})-(.+)' + re.escape(TMP_SUFFIX), name)
        step = run and run.group(1) in tokens and family.fullmatch(run.group(2))
        if step and int(step.group(1)) > newer_than:
            found.append((int(step.group(1)), name, run.group(2)))
    for _, name, final in sorted(found, reverse=True):
        if incomplete_reason(os.path.join(directory, name), meta_file, allow_unsafe) is None:
            path = os.path.join(directory, final)
            replace_path(os.path.join(directory, name), path)
            write_text_atomically(path, pointer)
            return path
    return None
