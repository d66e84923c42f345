"""Turn a sharded checkpoint directory into one full checkpoint file.

In one process, without a process group; the result is what
``state_dict_type='full'`` writes (``ema_state_dict`` included)::

    python -m mmfsdp.consolidate work_dirs/exp/iter_1000.pth work_dirs/exp/iter_1000_full.pth
"""
import argparse
import os
from typing import Any, Dict, Optional, Sequence

from .checkpoint.durable import save_atomically
from .checkpoint.safe_io import UnsafeCheckpointError, read_all_shards
from .checkpoint.state import is_sharded_checkpoint, read_sharded_meta
from .ema import EMA_SHARDS_KEY, full_ema_entries

__all__ = ['consolidate', 'main']


def consolidate(src: str, dst: str, allow_unsafe: bool = False) -> Dict[str, Any]:
    """Write the full checkpoint of the sharded directory ``src`` to ``dst``; return it.

    Like ``cp``, it creates no folders: ``dst``'s parent directory must exist.
    """
    if not is_sharded_checkpoint(src):
        raise ValueError(f'{src} is not a sharded mmfsdp checkpoint directory')
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f'cannot write {dst}: the directory {parent} does not exist')
    checkpoint = read_sharded_meta(src, allow_unsafe)
    extras = checkpoint.pop('optimizer_extras', None)
    param_groups = checkpoint.pop('optimizer_param_groups', None)
    shards = read_all_shards(src, allow_unsafe)
    checkpoint['state_dict'] = shards['model']
    if EMA_SHARDS_KEY in shards:  # EMAHook's convention, see mmfsdp.ema
        ema = shards[EMA_SHARDS_KEY]
        checkpoint.update(full_ema_entries(shards['model'], ema['state_dict'], ema['steps']))
    if param_groups is not None:
        # No optimizer shards: the optimizer had no state (e.g. SGD without momentum).
        saved = shards.get('optimizer', {})
        optimizer = (saved or dict(state={}) if isinstance(param_groups, list)
                     else {name: saved.get(name, dict(state={})) for name in param_groups})
        if 'state' in optimizer:
            checkpoint['optimizer'] = dict(extras or {}, param_groups=param_groups, **optimizer)
        else:
            checkpoint['optimizer'] = {
                name: dict((extras or {}).get(name, {}), param_groups=param_groups[name], **own)
                for name, own in optimizer.items()}
    save_atomically(checkpoint, dst)
    return checkpoint


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog='python -m mmfsdp.consolidate',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('src', help='sharded checkpoint directory (e.g. iter_1000.pth/)')
    parser.add_argument('dst', help='full checkpoint file to write (its directory must exist)')
    parser.add_argument('--allow-unsafe-checkpoints', action='store_true',
                        help='read a checkpoint that needs plain pickle (runs code it holds: '
                             'only for a checkpoint you trust)')
    args = parser.parse_args(argv)
    try:
        consolidate(args.src, args.dst, allow_unsafe=args.allow_unsafe_checkpoints)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(1, f'{parser.prog}: error: {e}\n')
    except UnsafeCheckpointError as e:  # its advice names the config key; here it is a flag
        parser.exit(1, f'{parser.prog}: error: {e} (this command: --allow-unsafe-checkpoints)\n')
    print(f'wrote {args.dst}')


if __name__ == '__main__':
    main()
