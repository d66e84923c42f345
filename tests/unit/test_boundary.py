"""The compat boundary: outside ``mmfsdp/compat/`` no module touches private torch or mmengine API.

An ast scan of every other module of the package (nothing of it runs) refuses:

- importing a private module or name of torch or mmengine (``import torch._dynamo``,
  ``from torch.distributed.fsdp._runtime_utils import ...``, ``from mmengine.x import _y``);
- a private attribute (``_name``; not ``__dunder__``) reached from a name such an import binds
  (``torch._C``, ``nn.Module._apply``, ``dist.distributed_c10d._world``, ``torch.ones(1)._cdata``);
- in a class with torch or mmengine bases, ``self._name`` or ``def _name`` where one of those
  bases defines ``_name`` (``self._ema_started(runner)``; overriding a private method counts);
- ``obj._name`` on any other object where ``_name`` is a private attribute of a class of the
  :data:`INTROSPECTED` modules (in its MRO's ``vars()`` or assigned as ``self._name =`` in its
  source) that mmfsdp itself never defines (``module._modules``, ``runner._resume``);
- ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with such a name as a literal.

Each such use belongs in ``mmfsdp/compat/``, as a named function with a ``# why:`` and a guard
test in ``tests/unit/test_compat.py``.
"""
import ast
import collections
import importlib
import re
import sys
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterator, List, Mapping, Set, Tuple

import mmfsdp

PACKAGE = Path(mmfsdp.__file__).parent
EXTERNAL = ('torch', 'mmengine')
#: Where the classes of the objects mmfsdp handles come from: modules, tensors, FSDP, DDP,
#: DCP, optimizers, data; mmengine's runner, loops, hooks, models, wrappers, optimizer
#: wrappers, logging, config and registries.
INTROSPECTED = (
    'torch', 'torch.nn', 'torch.nn.parallel', 'torch.optim', 'torch.distributed',
    'torch.distributed.fsdp', 'torch.distributed.tensor', 'torch.distributed.device_mesh',
    'torch.distributed.checkpoint', 'torch.distributed.checkpoint.state_dict',
    'torch.utils.data', 'mmengine.runner', 'mmengine.hooks', 'mmengine.model',
    'mmengine.model.wrappers', 'mmengine.optim', 'mmengine.logging', 'mmengine.config',
    'mmengine.registry', 'mmengine.dataset', 'mmengine.structures', 'mmengine.evaluator',
    'mmengine.visualization')

#: Private uses in the files engineer F refactors (``mmfsdp/wrappers/*``, ``options.py``,
#: ``policies.py``, ``layers.py``) as (path, name): engineer F moves these into compat and
#: the coordinator empties this list. Nothing else is ever added to it.
ALLOWED: FrozenSet[Tuple[str, str]] = frozenset()

#: Underscored names that are public API: a namedtuple's ``_fields``, ``_replace`` ...
PUBLIC = frozenset(n for n in vars(collections.namedtuple('T', '')) if not n.startswith('__'))


def _private(name: str) -> bool:
    """``_name``; not a ``__dunder__``, an Enum's ``_sunder_`` or a namedtuple's ``_fields``."""
    return name.startswith('_') and not name.endswith('_') and name not in PUBLIC


def _is_external(module: Any) -> bool:
    return isinstance(module, str) and module.split('.')[0] in EXTERNAL


#: ``self._name = ``, ``self._name: T = ``, ``__setattr__('_name'``, ``setattr(self, '_name'``.
_SELF_ASSIGNED = re.compile(r'self\.(_\w+)\s*(?::[^=\n]*)?=[^=]'
                            r'|(?:__setattr__\(|setattr\(self,)\s*[\'"](_\w+)[\'"]')
_TOP_LEVEL = re.compile(r'^(?:class (\w+)|\S)', re.MULTILINE)


@cache
def _assigned_in_classes(module: str) -> Dict[str, FrozenSet[str]]:
    """Top-level class name -> the names of its source's ``self._name =``, for a module."""
    path = getattr(sys.modules.get(module), '__file__', None) or ''
    if not path.endswith('.py'):
        return {}
    text, found = Path(path).read_text(), {}
    starts = [(m.start(), m.group(1)) for m in _TOP_LEVEL.finditer(text)]
    for (start, name), (end, _) in zip(starts, starts[1:] + [(len(text), None)]):
        if name:
            found[name] = frozenset(n for m in _SELF_ASSIGNED.findall(text, start, end)
                                    for n in m if _private(n))
    return found


@cache
def _defined_by(cls: type) -> FrozenSet[str]:
    """The private names ``cls`` itself defines: in its ``vars()`` or as ``self._name =``."""
    assigned = _assigned_in_classes(cls.__module__).get(cls.__qualname__.split('.')[0], frozenset())
    return frozenset({n for n in vars(cls) if _private(n)} | assigned)


def _external_private(classes) -> FrozenSet[str]:
    """Private names the torch / mmengine classes of the MROs of ``classes`` define."""
    return frozenset(n for cls in classes for k in cls.__mro__
                     if _is_external(k.__module__) for n in _defined_by(k))


@cache
def external_private_names() -> FrozenSet[str]:
    """Every private name the classes of the :data:`INTROSPECTED` modules define."""
    classes = []
    with warnings.catch_warnings():  # deprecated aliases (torch.distributed.reduce_op)
        warnings.simplefilter('ignore')
        for name in INTROSPECTED:
            classes += [v for v in vars(importlib.import_module(name)).values()
                        if isinstance(v, type) and _is_external(v.__module__)]
    return _external_private(classes)


def _root(node: ast.AST) -> ast.AST:
    """The start of ``a.b(c)[d].e``: ``a``."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


class Scan(ast.NodeVisitor):
    """One module's private uses (``found``) and the private names it defines (``defines``).

    ``namespace`` (the imported module's) resolves class bases; ``defined``: the private
    names mmfsdp defines anywhere (an ``obj._name`` with one of them is taken as mmfsdp's).
    """

    def __init__(self, source: str, namespace: Mapping[str, Any],
                 defined: FrozenSet[str] = frozenset()) -> None:
        self.tree, self.namespace, self.defined = ast.parse(source), namespace, defined
        self.imported: Dict[str, str] = {}  # local name -> what it names in torch / mmengine
        self.found: List[Tuple[int, str, str]] = []  # (line, name, why)
        self.defines: Set[str] = set()
        self.classes: List[FrozenSet[str]] = []  # per enclosing class: its bases' private names
        self.selves: List[Tuple[str, FrozenSet[str]]] = []  # per method: (self's name, class's)
        self.methods: Set[int] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                self.imported.update((a.asname or a.name.split('.')[0],
                                      a.name if a.asname else a.name.split('.')[0])
                                     for a in node.names if _is_external(a.name))
            elif isinstance(node, ast.ImportFrom) and not node.level and _is_external(
                    node.module):
                self.imported.update((a.asname or a.name, f'{node.module}.{a.name}')
                                     for a in node.names)
        self.visit(self.tree)

    def _flag(self, node: ast.AST, name: str, why: str) -> None:
        self.found.append((node.lineno, name, why))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_external(alias.name) and any(map(_private, alias.name.split('.'))):
                self._flag(node, alias.name, 'private module imported')

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names if not node.level and _is_external(node.module) else ():
            name = f'{node.module}.{alias.name}'
            if any(map(_private, name.split('.'))):
                self._flag(node, name, 'private name imported')

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [b for b in map(self._resolve, node.bases) if isinstance(b, type)]
        private = _external_private(bases)
        self.classes.append(private)
        self.methods.update(id(item) for item in node.body
                            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        for item in node.body:
            names = ([item.name] if isinstance(
                item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                [t.id for t in getattr(item, 'targets', [getattr(item, 'target', None)])
                 if isinstance(t, ast.Name)])
            for name in filter(_private, names):
                if name in private:
                    self._flag(item, name, f"overrides a private name of {node.name}'s bases")
                else:
                    self.defines.add(name)
        self.generic_visit(node)
        self.classes.pop()

    def _resolve(self, node: ast.AST) -> Any:
        """What a base class expression ``a.b.c`` names in the module, if it can tell."""
        names = []
        while isinstance(node, ast.Attribute):
            names.insert(0, node.attr)
            node = node.value
        value = self.namespace.get(node.id) if isinstance(node, ast.Name) else None
        for name in names:
            value = getattr(value, name, None)
        return value

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if not self.classes and _private(node.name):
            self.defines.add(node.name)  # a module's private function
        arguments = node.args.posonlyargs + node.args.args
        method = id(node) in self.methods and arguments
        if method:
            self.selves.append((arguments[0].arg, self.classes[-1]))
        self.generic_visit(node)
        if method:
            self.selves.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        if not self.classes:  # a module's private constant
            self.defines.update(t.id for t in node.targets
                                if isinstance(t, ast.Name) and _private(t.id))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr):
            self._check(node, node.value, node.attr, isinstance(node.ctx, ast.Store))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = node.args[1] if len(node.args) > 1 else None
        if (isinstance(node.func, ast.Name)
                and node.func.id in ('getattr', 'setattr', 'hasattr', 'delattr')
                and isinstance(name, ast.Constant) and isinstance(name.value, str)
                and _private(name.value)):
            self._check(node, node.args[0], name.value, node.func.id == 'setattr')
        self.generic_visit(node)

    def _check(self, node: ast.AST, value: ast.AST, name: str, store: bool) -> None:
        root = _root(value)
        if isinstance(root, ast.Name) and root.id in self.imported:
            self._flag(node, f'{ast.unparse(value)}.{name}',
                       f'private attribute of {root.id} = {self.imported[root.id]}')
            return
        if self.selves and isinstance(value, ast.Name) and value.id == self.selves[-1][0]:
            if name in self.selves[-1][1]:
                self._flag(node, name, 'private attribute of torch / mmengine base classes')
                return
            if store:
                self.defines.add(name)
                return
        if name in external_private_names() and name not in self.defined | self.defines:
            self._flag(node, name, 'private attribute of a torch / mmengine class')


def _modules() -> List[Path]:
    return sorted(p for p in PACKAGE.rglob('*.py')
                  if 'compat' not in p.relative_to(PACKAGE).parts)


def _scan(path: Path, defined: FrozenSet[str] = frozenset()) -> Scan:
    parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
    module = importlib.import_module('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
    return Scan(path.read_text(), vars(module), defined)


def private_uses() -> Iterator[Tuple[str, int, str, str]]:
    """(path, line, name, why) for each private torch / mmengine use outside ``compat/``."""
    defined = frozenset().union(*(_scan(p).defines for p in _modules()))
    for path in _modules():
        for line, name, why in _scan(path, defined).found:
            yield str(path.relative_to(PACKAGE.parent)), line, name, why


def test_no_private_torch_or_mmengine_use_outside_compat():
    uses = list(private_uses())
    unexpected = [u for u in uses if (u[0], u[2]) not in ALLOWED]
    assert not unexpected, (
        'private torch / mmengine API outside mmfsdp/compat/: move each use into mmfsdp/compat/ '
        'with a # why: and a guard test in tests/unit/test_compat.py\n'
        + '\n'.join(f'{path}:{line}: {name} ({why})' for path, line, name, why in unexpected))
    gone = ALLOWED - {(u[0], u[2]) for u in uses}
    assert not gone, f'no longer used: remove {sorted(gone)} from ALLOWED'


def test_the_scan_finds_each_kind_of_private_use():
    from mmengine.hooks import EMAHook
    from torch import nn
    source = '''
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._runtime_utils import _reshard
from mmengine.hooks import EMAHook, _private_helper

class Mine:
    def __init__(self):
        self._kept = 1
        self._modules = {}                        # its own, in a class with no torch base

class Hook(EMAHook):
    def __init__(self):
        self._own = 1

    def after_train_iter(self, runner):
        self._own, mine = 2, Mine()
        mine._kept = getattr(mine, '_kept', self._own)
        return self._ema_started(runner), torch._C, nn.Module._apply, dist.distributed_c10d._world

    def _swap_ema_parameters(self):
        return torch.ones(1)._cdata, getattr(runner, '_resume'), owner._parameters
'''
    found = [(line - 1, name) for line, name, _ in Scan(source, vars()).found]
    assert found == [
        (1, 'torch._dynamo'), (4, 'torch.distributed.fsdp._runtime_utils._reshard'),
        (5, 'mmengine.hooks._private_helper'), (21, '_swap_ema_parameters'),
        (19, '_ema_started'), (19, 'torch._C'), (19, 'nn.Module._apply'),
        (19, 'dist.distributed_c10d._world'), (22, 'torch.ones(1)._cdata'), (22, '_resume'),
        (22, '_parameters')], found
    assert EMAHook and nn  # the namespace the scan resolves the bases in
