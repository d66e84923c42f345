"""The runner's state is declared where it is made: no ``getattr(self, name, default)``.

A default behind ``getattr`` hides which attributes a runner has and from when; what the
checkpoint methods carry between calls is one
:class:`~mmfsdp.checkpoint.runner_methods.CheckpointState`, made once in ``__init__``.
"""
import ast
from pathlib import Path

import mmfsdp
from mmfsdp.checkpoint.runner_methods import CheckpointMixin, CheckpointState

PACKAGE = Path(mmfsdp.__file__).parent


def test_no_runner_state_behind_getattr_defaults():
    found = []
    for path in [PACKAGE / 'runner.py', *sorted((PACKAGE / 'checkpoint').glob('*.py'))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == 'getattr' and len(node.args) == 3
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == 'self'):
                found.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno}: '
                             f'{ast.unparse(node)}')
    assert not found, 'state behind getattr defaults (declare it in __init__):\n' + '\n'.join(found)


def test_checkpoint_state_is_made_once_with_the_runner():

    class Base:

        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

    class Runner(CheckpointMixin, Base):
        pass

    runner = Runner(work_dir='w')
    state = runner.checkpoint_state
    assert isinstance(state, CheckpointState) and runner.kwargs == dict(work_dir='w')
    assert (state.in_flight, state.token, state.resumed_tokens, state.resuming) == (
        None, None, [], False)
    assert runner.checkpoint_in_flight() is None
    assert Runner().checkpoint_state.stager is not state.stager  # one per runner
