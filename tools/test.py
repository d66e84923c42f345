"""Evaluate a checkpoint with the test loop of an mmengine config.

Usage:
    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--tta]
        [--cfg-options KEY=VALUE ...] [--launcher {none,pytorch,slurm,mpi}]

Distributed runs go through ``tools/dist_test.sh``. This script never
initialises the process group itself: the runner does.
"""
import argparse
import os
import os.path as osp

from mmengine.config import DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

# Importing mmfsdp fills its registries (models, datasets, wrappers, runner).
import mmfsdp  # noqa: F401
from mmfsdp.registry import load_config
from mmfsdp.tta import tta_config


def parse_args() -> argparse.Namespace:
    """Parse the command line (OpenMMLab ``tools/test.py`` conventions)."""
    parser = argparse.ArgumentParser(description='Test (evaluate) a model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file to evaluate')
    parser.add_argument(
        '--work-dir',
        help='directory for the evaluation logs; default '
        './work_dirs/<config name>')
    parser.add_argument(
        '--tta',
        action='store_true',
        help='test-time augmentation: test the config\'s tta_model on its tta_pipeline')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override settings of the config, as key=value pairs')
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


def main() -> None:
    """Load the config, point it at the checkpoint, and run the test loop."""
    args = parse_args()
    cfg = load_config(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)

    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])

    cfg.load_from = args.checkpoint
    if args.tta:
        cfg = tta_config(cfg)

    if 'runner_type' in cfg:
        runner = RUNNERS.build(cfg)
    else:
        runner = Runner.from_cfg(cfg)
    runner.test()


if __name__ == '__main__':
    main()
