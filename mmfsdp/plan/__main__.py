"""Dry run: ``python -m mmfsdp.plan CONFIG --world-size 1 8 64 [--cfg-options ...]``.

Builds the config's model on the meta device (no process group, no memory,
seconds even for billions of parameters), applies the configured wrapper and
policy, and prints the plan for each world size, as tables or as JSON.
"""
import argparse
import json
import sys
from typing import Optional, Sequence

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import MODELS

import mmfsdp  # noqa: F401  (fills the registries)

from ..wrappers.builder import resolve_wrapper_type
from . import format_plan, plan_for, plan_to_dict

DEFAULT_WRAPPER = dict(type='mmfsdp.MMDistributedDataParallel')


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog='python -m mmfsdp.plan',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('config', help='an mmengine config file')
    parser.add_argument('--world-size', type=int, nargs='+', default=[1, 8, 64])
    parser.add_argument('--format', choices=['table', 'json'], default='table')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='override settings of the config, as key=value pairs')
    args = parser.parse_args(argv)
    cfg = Config.fromfile(args.config)
    cfg.merge_from_dict(args.cfg_options)
    wrapper_cfg = dict(cfg.get('model_wrapper_cfg') or DEFAULT_WRAPPER)
    wrapper_cls = resolve_wrapper_type(wrapper_cfg)
    with torch.device('meta'):
        model = MODELS.build(cfg.model)
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer', {})
    plans = [plan_for(wrapper_cls, wrapper_cfg, model, n, optimizer) for n in args.world_size]
    if args.format == 'json':
        json.dump([plan_to_dict(p) for p in plans], sys.stdout, indent=1)
        print()
        return
    print('\n\n'.join(format_plan(p) for p in plans))


if __name__ == '__main__':
    main()
