"""Asynchronous saves: staged on the main thread, written in the background, published later.

``default_hooks.checkpoint.async_save=True`` splits a save in three:

1. **stage** (main thread, training blocked): the state is gathered as for a
   synchronous save and copied, so that training may change it. A full
   checkpoint is copied on rank 0's CPU; a sharded one goes through DCP's
   ``async_save``, whose stager copies each rank's shards to its CPU;
2. **write** (a background thread per rank, training goes on): only files under
   the temporary name ``<token>-NAME.tmp``. A sharded write coordinates its
   ranks on a gloo group of its own (:func:`writer_group`), never on the
   groups training uses, so its collectives cannot interleave with training's;
3. **publish** (main thread, every rank, at the next save, at the end of
   ``train()`` or at exit): every rank waits for its own write, the ranks agree
   that every write finished (:func:`mmfsdp.together.fail_together`), then
   rank 0 renames the temporary into place and the hook repoints
   ``last_checkpoint`` and deletes what ``max_keep_ckpts`` expires.

A write that failed on any rank is raised on every rank at step 3, naming the
rank and its error; nothing is renamed. A crash before step 3 leaves only the
temporary, which auto-resume never picks. See ``docs/checkpoints.md``.
"""
import collections
import concurrent.futures
import copy
import datetime
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..compat import dtensor_like
from ..options import resolve_flag
from ..together import fail_together
from .durable import remove_stale_temporaries, replace_path, save_atomically

__all__ = ['BackgroundWrite', 'ShardStager', 'resolve_async_save', 'write_file_in_background',
           'write_meta_after', 'writer_group']


def resolve_async_save(value: Any) -> bool:
    """``async_save``: ``True`` (write in the background) or ``False`` (the default)."""
    return resolve_flag(value, 'default_hooks.checkpoint.async_save')


_WRITER_GROUPS: Dict[Tuple[Any, float], Optional[dist.ProcessGroup]] = {}


def writer_group(timeout_s: float) -> Optional[dist.ProcessGroup]:
    """The gloo group over all ranks that background sharded writes coordinate on.

    Its own group: a collective in the writer thread on a group that training
    also uses could pair with a training collective of another rank (gloo
    matches collectives by order). Created at the first sharded background
    save, which every rank makes at the same point; ``None`` without a group.
    """
    if not dist.is_initialized():
        return None
    key = (dist.group.WORLD, timeout_s)
    if key not in _WRITER_GROUPS:
        _WRITER_GROUPS[key] = dist.new_group(
            backend='gloo', timeout=datetime.timedelta(seconds=timeout_s))
    return _WRITER_GROUPS[key]


class ShardStager(AsyncStager):
    """The copies of background saves (training may change the state), reused between saves.

    One per runner. Each tensor of a save is copied to the CPU into the
    previous save's copy at the same place when that has its shape, dtype and
    strides: no allocation and no page faults, which were most of the time a
    save blocks. Sharded saves go through :meth:`stage` (DCP's stager
    protocol; FSDP1's ``ShardedTensor``, a new object per ``state_dict()``,
    gets its local shards swapped for the copies: torch 2.13's
    ``DefaultStager`` fails on it), full checkpoints through :meth:`copy`.
    Copies are reused only once the write that read them (:meth:`written_by`)
    is done, so a write never sees the next save's values.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._kept: Dict[str, Dict[Tuple[Any, ...], torch.Tensor]] = {}
        self._reader: Optional[concurrent.futures.Future] = None

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of a sharded save's ``state_dict`` that training cannot change, on the CPU."""
        return self.copy(state_dict, 'shards')

    def copy(self, tree: Any, kind: str = 'full') -> Any:
        """A CPU copy of ``tree`` (dicts, lists and tuples of tensors and values).

        ``kind`` names the saves whose copies are reused for each other.
        """
        if self._reader is not None and not self._reader.done():
            self._kept = {}  # that write's wait timed out: it may still read them
        previous, fresh = self._kept.get(kind, {}), {}
        self._kept[kind] = fresh
        by_id: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # aliases copied once

        def tensor(path: Tuple[Any, ...], source: torch.Tensor) -> torch.Tensor:
            if id(source) not in by_id:
                old = previous.get(path)
                fits = old is not None and (old.shape, old.dtype, old.stride()) == (
                    source.shape, source.dtype, source.stride())
                by_id[id(source)] = source, (old.copy_(source.detach()) if fits
                                             else source.detach().to('cpu', copy=True))
            fresh[path] = by_id[id(source)][1]
            return fresh[path]

        def walk(node: Any, path: Tuple[Any, ...]) -> Any:
            if type(node) in (dict, collections.OrderedDict):
                return type(node)((k, walk(v, path + (k,))) for k, v in node.items())
            if type(node) in (list, tuple):
                return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
            if isinstance(node, DTensor):
                return dtensor_like(node, tensor(path, node.to_local()))
            if callable(getattr(node, 'local_shards', None)):  # FSDP1's ShardedTensor
                for i, shard in enumerate(node.local_shards()):
                    shard.tensor = tensor(path + (i,), shard.tensor)
                return node
            if type(node) is torch.Tensor:
                return tensor(path, node)
            return copy.deepcopy(node)

        return walk(tree, ())

    def written_by(self, future: Optional[concurrent.futures.Future]) -> None:
        """The write that reads the last copy: its tensors are reused once it is done."""
        self._reader = future

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """Nothing to release: the copies are kept for the next save."""


def _run_in_thread(fn: Callable[[], None]) -> concurrent.futures.Future:
    # an executor's threads are joined before the interpreter exits: exit waits for the write
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='mmfsdp-checkpoint')
    try:
        return executor.submit(fn)
    finally:
        executor.shutdown(wait=False)


def write_file_in_background(obj: Any, tmp: str) -> concurrent.futures.Future:
    """``torch.save`` ``obj`` (already a private copy) to ``tmp`` and ``fsync`` it, in a thread.

    Written through a Python file object, so that a full disk raises
    ``OSError`` with its ``errno`` (torch's own file writer says only "file
    write failed").
    """
    def write() -> None:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    return _run_in_thread(write)


def write_meta_after(upload: concurrent.futures.Future, extra: Optional[Dict[str, Any]],
                     directory: str, meta_file: str) -> concurrent.futures.Future:
    """A future that ends when DCP's ``upload`` has and (rank 0) ``extra`` is written after it.

    DCP's save returns on rank 0 only once every rank's shards are written, so
    ``meta_file`` (whose presence marks a complete directory) is written last.
    """
    done: concurrent.futures.Future = concurrent.futures.Future()

    def then(finished: concurrent.futures.Future) -> None:
        try:
            finished.result()
            if extra is not None:
                save_atomically(extra, os.path.join(directory, meta_file))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            done.set_exception(e)
        else:
            done.set_result(None)

    upload.add_done_callback(then)
    return done


class BackgroundWrite:
    """One checkpoint being written in the background, and what publishing it takes.

    Args:
        path: the checkpoint's final name.
        tmp: the temporary it is written to.
        token: the run's token (for :func:`replace_path`'s rename-aside).
        clean_tokens: the tokens whose temporaries go once it is published.
        wait_s: how long the ranks wait for each other's writes.
        future: this rank's write (``None`` on a rank that writes nothing).

    """

    def __init__(self, path: str, tmp: str, token: str, clean_tokens: Sequence[str],
                 wait_s: float, future: Optional[concurrent.futures.Future]) -> None:
        self.path, self.tmp, self.token = path, tmp, token
        self.clean_tokens = list(clean_tokens)
        self.wait_s = wait_s
        self.future = future
        #: Run on every rank once the checkpoint is in place (the hook's repoint and delete).
        self.callbacks: List[Callable[[], None]] = []

    def wait(self) -> None:
        """Wait for this rank's write; raise this rank's error, if its write failed.

        A sharded write that failed on another rank raises DCP's
        ``CheckpointException`` on every rank; here only the rank that failed
        raises (its own error), so that :meth:`publish`'s agreement names it on
        the others.
        """
        if self.future is None:
            return
        try:
            self.future.result(timeout=self.wait_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f'writing {self.tmp} took longer than save_timeout='
                               f'{self.wait_s} s') from None
        except CheckpointException as e:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank in e.failures:
                raise e.failures[rank][0] from None
            if not dist.is_initialized():  # no other rank to name it: say what DCP said
                raise RuntimeError(str(e)) from None

    def publish(self, is_writer_of_record: bool) -> None:
        """Agree that every rank's write finished, rename into place, run the callbacks.

        Collective; ``is_writer_of_record``: this rank renames (rank 0).
        """
        with fail_together(f'saving checkpoint {self.path} (written in the background)',
                           self.wait_s):
            self.wait()
        with fail_together(f'publishing checkpoint {self.path}', self.wait_s):
            if is_writer_of_record:
                replace_path(self.tmp, self.path, self.token)
                remove_stale_temporaries(os.path.dirname(os.path.abspath(self.path)),
                                         self.clean_tokens)
        for callback in self.callbacks:
            callback()

    def abandon(self) -> Optional[BaseException]:
        """Wait for this rank's write (bounded by ``wait_s``) without publishing; its error."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            return e
        return None
