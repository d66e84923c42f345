"""Dry run: ``python -m mmfsdp.plan CONFIG --world-size 1 8 64 [--cfg-options ...]``.

Builds the config's model with its parameters and buffers on the meta device
(:func:`mmfsdp.meta_init.empty_weights`, as ``init_device='meta'`` builds it:
constructors may still compute with tensors; no process group, no memory,
seconds even for billions of parameters), applies the configured wrapper and
policy, and prints the plan for each world size, as tables or as JSON.

Names are looked up as the Runner looks them up: in the registries of the
config's ``default_scope`` (e.g. ``default_scope = 'mmpretrain'`` with
``type='ImageClassifier'``), or of a dict's own ``_scope_``.
"""
import argparse
import contextlib
import json
import os
import sys
from typing import List, Optional, Sequence

from mmengine.config import DictAction
from mmengine.registry import MODELS, DefaultScope

import mmfsdp  # noqa: F401  (fills the registries)

from ..config import load_config
from ..ema import configures_ema
from ..meta_init import empty_weights
from ..wrappers.builder import resolve_wrapper_type
from . import Plan, format_plan, plan_for, plan_to_dict

DEFAULT_WRAPPER = dict(type='mmfsdp.MMDistributedDataParallel')
PROG = 'python -m mmfsdp.plan'


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split('\n\n')[0])
    parser.add_argument('config', help='an mmengine config file')
    parser.add_argument('--world-size', type=int, nargs='+', default=[1, 8, 64])
    parser.add_argument('--format', choices=['table', 'json'], default='table')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='override settings of the config, as key=value pairs')
    args = parser.parse_args(argv)
    # stdout carries the plan alone (JSON for scripts); mmengine logs to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        plans = _plans(args.config, args.cfg_options, args.world_size)
    if args.format == 'json':
        _print(json.dumps([plan_to_dict(p) for p in plans], indent=1))
    else:
        _print('\n\n'.join(format_plan(p) for p in plans))


def _plans(config: str, cfg_options: dict, world_sizes: Sequence[int]) -> List[Plan]:
    cfg = load_config(config)
    cfg.merge_from_dict(cfg_options)
    scope = cfg.get('default_scope', 'mmengine')
    wrapper_cfg = dict(cfg.get('model_wrapper_cfg') or DEFAULT_WRAPPER)
    wrapper_cls = resolve_wrapper_type(wrapper_cfg, scope)
    with DefaultScope.overwrite_default_scope(scope), empty_weights(record=False):
        model = MODELS.build(cfg.model)
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer', {})
    ema = configures_ema(cfg.get('custom_hooks'))
    return [plan_for(wrapper_cls, wrapper_cfg, model, n, optimizer, ema=ema)
            for n in world_sizes]


def _print(text: str) -> None:
    """Print ``text``; a reader that stops early (``| head``) ends the program quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the failed flush of stdout again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == '__main__':
    main()
