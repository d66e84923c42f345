"""What the zoo tests share: running a codebase's own tools as jobs, and reading their results."""
import sys
from pathlib import Path
from typing import List

import torch

from harness import REPO, free_port, job_env, run_job

#: A tool's job: a few training steps of a small model, or its evaluation.
JOB_TIMEOUT_S = 900
#: The stock tools are not mmfsdp's: mmengine 0.10.7 reads its own checkpoints (``HistoryBuffer``
#: in ``message_hub``) only with torch's pre-2.6 unrestricted ``torch.load``. Set for the stock
#: runs only; mmfsdp's jobs (and a stock test.py reading mmfsdp's checkpoint) run without it, so
#: mmfsdp's own loading is tested as shipped.
STOCK_LOAD = 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'


def run_tool(cmd: List[str], stock: bool = False) -> str:
    """Run ``cmd`` from the repository root, mmfsdp importable; its output, or fail."""
    env = (job_env(REPO, **{STOCK_LOAD: '1'}) if stock
           else job_env(REPO, unset=(STOCK_LOAD, )))
    return run_job(cmd, env=env, timeout=JOB_TIMEOUT_S)


def torchrun(tool: Path, *args: str) -> List[str]:
    """``tool`` on 2 local ranks, as the codebases' dist_train.sh starts it."""
    return [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
            '--master_port', str(free_port()), str(tool), *args, '--launcher', 'pytorch']


def write_config(tmp_path_factory, text: str) -> Path:
    """``text`` as a config file outside the work dir (the Runner dumps its config there)."""
    path = tmp_path_factory.mktemp('cfg') / 'cfg.py'
    path.write_text(text)
    return path


def checkpoint_weights(path: Path) -> dict:
    """The floating-point weights of a checkpoint the stock tools wrote (read unrestricted):
    a full file, or a sharded directory (``FSDPStrategy``'s default, per-rank shards)."""
    if path.is_dir():
        from mmfsdp.consolidate import consolidate
        state = consolidate(str(path), f'{path}.full', allow_unsafe=True)['state_dict']
    else:
        state = torch.load(path, map_location='cpu', weights_only=False)['state_dict']
    return {k: v.float() for k, v in state.items() if v.is_floating_point()}
