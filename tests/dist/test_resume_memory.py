"""A resume keeps nothing of the checkpoint it loaded: the loaded state dict's tensors die."""
import gc
import weakref

from mmfsdp import FSDPRunner
from toy import FSDP1, checkpointing_config


def mapped_bytes(prefix: str) -> int:
    """Resident bytes of this process's mappings of files under ``prefix``."""
    total, inside = 0, False
    with open('/proc/self/smaps') as f:
        for line in f:
            head = line.split(None, 1)[0]
            if '-' in head and not head.endswith(':'):  # a mapping's header line
                inside = line.rstrip('\n').split(None, 5)[-1].startswith(prefix)
            elif inside and head == 'Rss:':
                total += int(line.split()[1]) * 1024
    return total


def test_a_resume_keeps_nothing_of_the_loaded_checkpoint(tmp_path):
    """The loaded tensors (mmap'd from the file) die with the resume; the weights live on."""
    def run(name, **extra):
        return FSDPRunner.from_cfg(checkpointing_config(
            str(tmp_path / name), FSDP1, 1, global_batch=4, max_iters=1, interval=1, **extra))

    run('saved').train()
    path = str(tmp_path / 'saved' / 'iter_1.pth')
    runner = run('resumed', resume_from=path)
    original, loaded, mapped = runner.load_checkpoint, [], []

    def load_checkpoint(*args, **kwargs):
        checkpoint = original(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in checkpoint['state_dict'].values())
        mapped.append(mapped_bytes(path))
        return checkpoint

    runner.load_checkpoint = load_checkpoint
    runner.load_or_resume()
    gc.collect()
    assert loaded and mapped[0] > 0, 'the full file was not loaded through a mapping'
    kept = [ref() for ref in loaded if ref() is not None]
    assert not kept, f'the runner keeps {len(kept)} tensors of the loaded checkpoint'
    assert runner.train_loop.iter == 1 and runner.optim_wrapper.optimizer.state
