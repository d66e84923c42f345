"""Nothing read executes code: the safe reader, in one process, without a process group.

One module reads files (an ast check of the package); refusals name the rejected
global whatever the payload; a DCP ``.metadata`` can point the reader only at
files of its own directory, within their size; ``init_cfg`` URLs and a
backbone's own ``load_checkpoint`` read through the safe reader inside
``safe_reads`` (a local ``http.server``; the 2-rank runner checks are in
``tests/dist/test_untrusted_sources.py``).
"""
import ast
import builtins
import contextlib
import io
import os
import pickle
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from mmengine.logging import HistoryBuffer
from mmengine.model import BaseModule
from mmengine.runner import CheckpointLoader, load_checkpoint
from torch import nn

import mmfsdp
from mmfsdp.checkpoint.safe_io import (
    IncompleteCheckpointError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_file,
    load_shards,
    safe_reads,
)
from payloads import CallsEval, CreatesFile, Plain, RunsCommand, serving

PACKAGE = Path(mmfsdp.__file__).parent
#: The one module that may unpickle.
READER = PACKAGE / 'checkpoint' / 'safe_io.py'
#: What unpickles or fetches and unpickles, by the name it is imported under.
READERS = ('torch.load', 'pickle.load', 'pickle.loads', 'pickle.Unpickler', 'torch.hub.load',
           'torch.hub.load_state_dict_from_url', 'torch.utils.model_zoo.load_url',
           'mmengine.utils.load_url', 'mmengine.utils.dl_utils.load_url',
           'mmengine.runner.CheckpointLoader', 'mmengine.runner.checkpoint.CheckpointLoader',
           'mmengine.runner.load_checkpoint', 'mmengine.runner.checkpoint.load_checkpoint',
           'mmengine.runner.checkpoint._load_checkpoint',
           'torch.distributed.checkpoint.FileSystemReader',
           'torch.distributed.checkpoint.filesystem.FileSystemReader')
#: (module, name) allowed outside the reader, and why.
ALLOWED = {
    # replaces CheckpointLoader.load_checkpoint by the safe reader; calls nothing of it
    ('compat/mmengine_private.py', 'mmengine.runner.CheckpointLoader'),
}


def _qualified_names(tree: ast.Module) -> Iterator[tuple]:
    """``(line, dotted name)`` of every name and attribute chain, imports resolved."""
    imported: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported[(alias.asname or alias.name).split('.')[0]] = \
                    alias.name if alias.asname else alias.name.split('.')[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                imported[alias.asname or alias.name] = f'{node.module}.{alias.name}'
                yield node.lineno, f'{node.module}.{alias.name}'
    for node in ast.walk(tree):
        parts: List[str] = []
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in imported:
            yield node.lineno, '.'.join([imported[node.id], *parts])


def _offenders(path: Path) -> List[str]:
    module = path.relative_to(PACKAGE).as_posix()
    return sorted({f'{module}:{line}: {name}' for line, name in _qualified_names(
        ast.parse(path.read_text())) for reader in READERS
        if (name == reader or name.startswith(reader + '.')) and (module, reader) not in ALLOWED})


def test_only_the_safe_reader_unpickles_or_fetches_files():
    offenders = [o for path in sorted(PACKAGE.rglob('*.py')) if path != READER
                 for o in _offenders(path)]
    assert offenders == [], 'read through mmfsdp.checkpoint.safe_io instead:\n' + '\n'.join(
        offenders)


def test_the_check_sees_every_way_of_naming_a_reader(tmp_path):
    (tmp_path / 'm.py').write_text(
        'import torch\nimport pickle as p\nfrom torch.hub import load_state_dict_from_url\n'
        'from mmengine.runner import CheckpointLoader as C\n'
        'torch.load("x")\np.loads(b"")\nC.load_checkpoint("x")\nf = torch.load\n')
    found = [name for _, name in _qualified_names(ast.parse((tmp_path / 'm.py').read_text()))
             if any(name == r or name.startswith(r + '.') for r in READERS)]
    assert sorted(set(found)) == sorted({
        'torch.load', 'pickle.loads', 'torch.hub.load_state_dict_from_url',
        'mmengine.runner.CheckpointLoader', 'mmengine.runner.CheckpointLoader.load_checkpoint'})


# ---- refusals name the global, whatever the payload -------------------------------------------

PAYLOADS = {
    'os.system via __reduce__': (RunsCommand('true'), f'{os.system.__module__}.system'),
    'builtins.eval via __reduce__': (CallsEval('1'), 'builtins.eval'),
    'a class instance': (Plain(), f'{Plain.__module__}.Plain'),
    'a class itself': (Plain, f'{Plain.__module__}.Plain'),
    'open via __reduce__': (CreatesFile('/nonexistent/x'), f'{open.__module__}.open'),
    'a numpy scalar': (np.float64(1.0), f'{np.float64(1).__reduce__()[0].__module__}.scalar'),
    'a numpy array': (np.zeros(2), '_reconstruct'),
    "mmengine's HistoryBuffer": (HistoryBuffer(), 'mmengine.logging.history_buffer.HistoryBuffer'),
}


@pytest.mark.parametrize('kind', sorted(PAYLOADS))
def test_a_refusal_names_the_rejected_global(tmp_path, kind):
    payload, name = PAYLOADS[kind]
    path = str(tmp_path / 'evil.pth')
    torch.save(dict(state_dict={}, payload=payload), path)
    for source in (path, io.BytesIO(Path(path).read_bytes())):  # a file, a backend's stream
        with pytest.raises(UnsafeCheckpointError) as refused:
            load_file(source)
        message = str(refused.value)
        assert name in message and 'allow_unsafe_checkpoints = True' in message, message
        assert 'Check the documentation' not in message


def test_a_pickle_protocol_torch_does_not_read_is_named(tmp_path):
    path = str(tmp_path / 'p4.pth')
    torch.save(dict(payload=Plain()), path, pickle_protocol=4)
    with pytest.raises(UnsafeCheckpointError, match='pickle instruction FRAME'), \
            warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch: "Detected pickle protocol 4"
        load_file(path)


# ---- a .metadata points the reader only at its own files, within their size ------------------

def _dcp_save(state: dict, path: Path) -> Path:
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.simplefilter('ignore')
        dcp.save(state, checkpoint_id=str(path))
    return path


def _pointed(path: Path, **fields) -> Path:
    """``path``'s ``.metadata`` with every storage entry changed as ``fields`` say (only
    allow-listed classes: it passes the metadata unpickler)."""
    metadata = SafeFileSystemReader(path).read_metadata()
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)(**{**vars(info), **{
            k: v(info) if callable(v) else v for k, v in fields.items()}})
    (path / '.metadata').write_bytes(pickle.dumps(metadata))
    return path


@contextlib.contextmanager
def _opened() -> Iterator[List[str]]:
    """The data files opened inside (``open`` audit events; Python sources left out)."""
    seen: List[str] = []
    _OPEN_AUDIT.append(seen)
    try:
        yield seen
    finally:
        _OPEN_AUDIT.remove(seen)


_OPEN_AUDIT: List[List[str]] = []


def _audit(event: str, args: tuple) -> None:
    if event == 'open' and _OPEN_AUDIT and isinstance(args[0], (str, bytes, os.PathLike)) \
            and not os.fsdecode(args[0]).endswith('.py'):
        _OPEN_AUDIT[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def two_checkpoints(tmp_path) -> Dict[str, Path]:
    """Two DCP checkpoints of one entry ``w``: ``other`` holds ones, ``mine`` zeros."""
    return dict(other=_dcp_save(dict(w=torch.ones(4)), tmp_path / 'other'),
                mine=_dcp_save(dict(w=torch.zeros(4)), tmp_path / 'mine'))


def _shard(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == '.distcp')


def _escape(case: str, checkpoints: Dict[str, Path]) -> Path:
    mine, other = checkpoints['mine'], checkpoints['other']
    if case == 'absolute path to another checkpoint':
        return _pointed(mine, relative_path=str(_shard(other)))
    if case == '../ path':
        return _pointed(mine, relative_path=f'../{other.name}/{_shard(other).name}')
    if case == '/dev/zero with a huge length':
        return _pointed(mine, relative_path='/dev/zero', offset=0, length=64 * 2**20)
    if case == 'a symlink out of the directory':
        (mine / 'link.distcp').symlink_to(_shard(other))
        return _pointed(mine, relative_path='link.distcp')
    raise KeyError(case)


ESCAPES = ('absolute path to another checkpoint', '../ path', '/dev/zero with a huge length',
           'a symlink out of the directory')


@pytest.mark.parametrize('case', ESCAPES)
def test_metadata_pointing_outside_its_directory_is_refused_before_any_read(two_checkpoints,
                                                                           case):
    path = _escape(case, two_checkpoints)
    loaded = dict(w=torch.full((4,), 7.0))
    with _opened() as opened, pytest.raises(UnsafeCheckpointError,
                                            match='reads only files named in the checkpoint'):
        load_shards(loaded, str(path), allow_unsafe=True)  # not even the switch allows it
    assert opened and all(name.endswith('.metadata') for name in opened), opened
    assert torch.equal(loaded['w'], torch.full((4,), 7.0))


def test_an_entry_past_the_end_of_its_file_is_refused_before_any_read(two_checkpoints):
    path = _pointed(two_checkpoints['mine'], length=lambda info: info.length + 2**30)
    with _opened() as opened, pytest.raises(IncompleteCheckpointError, match='truncated'):
        load_shards(dict(w=torch.zeros(4)), str(path))
    assert opened and all(name.endswith('.metadata') for name in opened), opened


def test_metadata_holding_part_of_a_tensor_is_incomplete_before_any_read(two_checkpoints):
    """What each rank of a write whose process group was gone wrote: its own chunks only."""
    path = two_checkpoints['mine']
    metadata = SafeFileSystemReader(path).read_metadata()
    metadata.state_dict_metadata['w'].size = torch.Size([8])  # the other rank's half is absent
    (path / '.metadata').write_bytes(pickle.dumps(metadata))
    with _opened() as opened, pytest.raises(
            IncompleteCheckpointError, match="does not hold 'w' whole: its chunks cover 4 of"):
        load_shards(dict(w=torch.zeros(8)), str(path))
    assert opened and all(name.endswith('.metadata') for name in opened), opened


def test_entries_inside_the_directory_still_load(two_checkpoints):
    loaded = dict(w=torch.full((4,), 7.0))
    load_shards(loaded, str(two_checkpoints['other']))
    assert torch.equal(loaded['w'], torch.ones(4))


# ---- init_cfg URLs and a backbone's own loader, inside safe_reads -----------------------------

class Backbone(BaseModule):

    def __init__(self, init_cfg=None, own_checkpoint: str = '') -> None:
        super().__init__(init_cfg=init_cfg)
        self.fc = nn.Linear(2, 2)
        self.own_checkpoint = own_checkpoint

    def init_weights(self) -> None:
        if self.own_checkpoint:  # as Swin backbones: their own call of mmengine's loader
            load_checkpoint(self, self.own_checkpoint, map_location='cpu', strict=False)
        else:
            super().init_weights()


@pytest.fixture
def served(tmp_path, monkeypatch) -> dict:
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))  # torch.hub's cache
    files = tmp_path / 'served'
    files.mkdir()
    marker = tmp_path / 'created-by-unpickling'
    weights = nn.Linear(2, 2).state_dict()
    # the backbone's keys, and a bigger model's ('backbone.' for init_cfg's prefix)
    state = {f'{prefix}fc.{k}': v for k, v in weights.items() for prefix in ('', 'backbone.')}
    torch.save(dict(state_dict=state, payload=CreatesFile(str(marker))), files / 'evil.pth')
    torch.save(dict(state_dict=state), files / 'benign.pth')
    with serving(files) as url:
        yield dict(url=url, marker=marker, weights=weights)


def _backbones(url: str) -> Dict[str, Backbone]:
    return {'init_cfg Pretrained': Backbone(init_cfg=dict(type='Pretrained', checkpoint=url)),
            'init_cfg Pretrained with a prefix': Backbone(
                init_cfg=dict(type='Pretrained', checkpoint=url, prefix='backbone')),
            'its own load_checkpoint': Backbone(own_checkpoint=url)}


def test_a_url_pickle_is_refused_on_every_init_path(served):
    for how, backbone in _backbones(f'{served["url"]}/evil.pth').items():
        with safe_reads(), pytest.raises(UnsafeCheckpointError) as refused:
            backbone.init_weights()
        assert f'{open.__module__}.open' in str(refused.value), how
        assert 'allow_unsafe_checkpoints = True' in str(refused.value), how
        assert not served['marker'].exists(), f'{how}: the payload ran'


def test_a_weights_only_url_loads_on_every_init_path(served):
    for how, backbone in _backbones(f'{served["url"]}/benign.pth').items():
        with safe_reads():
            backbone.init_weights()
        loaded = backbone.fc.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in served['weights'].items()), how


def test_with_the_switch_a_url_pickle_loads_with_a_warning(served):
    with safe_reads(allow_unsafe=True), pytest.warns(UserWarning, match='weights_only=False'):
        _backbones(f'{served["url"]}/evil.pth')['init_cfg Pretrained'].init_weights()
    assert served['marker'].exists()  # the user trusts this file


def test_safe_reads_restores_the_loaders():
    before = (torch.load, CheckpointLoader.__dict__['load_checkpoint'], builtins.open)
    with safe_reads():
        assert torch.load is not before[0]
    assert (torch.load, CheckpointLoader.__dict__['load_checkpoint'], builtins.open) == before
