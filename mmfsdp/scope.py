"""mmengine's ``_scope_`` key, honoured where mmengine itself passes it on.

A config that inherits another package's config (``_base_ =
['mmfsdp::...']``) gets ``_scope_='mmfsdp'`` in every inherited dict that has a
``type``. mmengine's ``build_from_cfg`` pops it and builds in that scope, but
``Runner.build_dataloader`` hands every key of ``collate_fn`` except ``type``
to the collate function, so ``default_collate`` fails on ``_scope_``. The
wrapper config is handled in :mod:`mmfsdp.wrappers.builder`.
"""
from typing import Any, Mapping

from mmengine.registry import FUNCTIONS

__all__ = ['without_collate_scope']


def without_collate_scope(dataloader: Any) -> Any:
    """A copy of a dataloader config whose ``collate_fn`` has no ``_scope_``.

    The collate function is looked up in the ``FUNCTIONS`` registry of that
    scope, as ``build_from_cfg`` would, and given as the ``type``. Anything
    else (a built ``DataLoader``, no ``_scope_``) is returned as it is.
    """
    if not isinstance(dataloader, Mapping):
        return dataloader
    collate = dataloader.get('collate_fn')
    if not isinstance(collate, Mapping) or '_scope_' not in collate:
        return dataloader
    collate = dict(collate)
    scope = collate.pop('_scope_')
    if isinstance(collate.get('type'), str):
        with FUNCTIONS.switch_scope_and_registry(scope) as registry:
            function = registry.get(collate['type'])
        if function is None:
            raise KeyError(f"the dataloader's collate_fn.type: {collate['type']!r} is not a "
                           f'registered function in the {scope!r} scope')
        collate['type'] = function
    return dict(dataloader, collate_fn=collate)
