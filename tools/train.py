"""Train a model from an mmengine config, with or without mmfsdp's runner.

Usage:
    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp]
        [--cfg-options KEY=VALUE ...] [--launcher {none,pytorch,slurm,mpi}]

Distributed runs go through ``tools/dist_train.sh``. This script never
initialises the process group itself: the runner does (mmfsdp's
``FSDPRunner`` picks gloo on CPU-only machines).
"""
import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

# Importing mmfsdp fills its registries (models, datasets, wrappers, runner).
import mmfsdp  # noqa: F401
from mmfsdp.registry import load_config

AMP_OPTIM_WRAPPER = 'mmfsdp.AmpOptimWrapper'


def parse_args() -> argparse.Namespace:
    """Parse the command line (OpenMMLab ``tools/train.py`` conventions)."""
    parser = argparse.ArgumentParser(description='Train a model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument(
        '--work-dir',
        help='directory for logs and checkpoints; default '
        './work_dirs/<config name>')
    parser.add_argument(
        '--resume',
        nargs='?',
        type=str,
        const='auto',
        help='resume from the given checkpoint, or, without a path, from '
        'the latest checkpoint in the work directory')
    parser.add_argument(
        '--amp',
        action='store_true',
        help=f'train with automatic mixed precision ({AMP_OPTIM_WRAPPER})')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override settings of the config, as key=value pairs; '
        'e.g. train_cfg.max_iters=40')
    parser.add_argument(
        '--launcher',
        choices=['none', 'pytorch', 'slurm', 'mpi'],
        default='none',
        help='job launcher')
    # torch.distributed.launch (and so `mim train/test --launcher pytorch`)
    # passes --local-rank; torchrun sets LOCAL_RANK instead. Only a given
    # value is exported: a default of 0 would also reach slurm and mpi
    # ranks, whose local rank the runner takes from SLURM_LOCALID /
    # OMPI_COMM_WORLD_LOCAL_RANK only while LOCAL_RANK is unset.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=None)
    args = parser.parse_args()
    if args.local_rank is not None:
        os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def enable_amp(cfg: Config) -> None:
    """Switch ``cfg.optim_wrapper`` to ``mmfsdp.AmpOptimWrapper`` (any device)."""
    optim_wrapper = cfg.optim_wrapper.get('type', 'OptimWrapper')
    if optim_wrapper in ('AmpOptimWrapper', AMP_OPTIM_WRAPPER):
        print(f'--amp ignored: optim_wrapper is already {optim_wrapper}')
        return
    cfg.optim_wrapper.type = AMP_OPTIM_WRAPPER
    cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')


def main() -> None:
    """Load the config, apply the command-line overrides, and train."""
    args = parse_args()
    cfg = load_config(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)

    # Work directory priority: command line > config > ./work_dirs/<name>.
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])

    if args.amp:
        enable_amp(cfg)

    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume

    if 'runner_type' in cfg:
        runner = RUNNERS.build(cfg)
    else:
        runner = Runner.from_cfg(cfg)
    runner.train()


if __name__ == '__main__':
    main()
