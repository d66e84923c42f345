"""Which checkpoint entries load into which model keys: mmengine's ``load_from`` semantics.

mmengine's ``load_checkpoint(strict=False)`` renames keys by ``revise_keys``,
loads what fits, skips what does not (a missing key, an unexpected key, or a
shape that differs, as when fine-tuning into a new classification head) and
lists all of it in one warning. :func:`match_keys` makes that decision from
names and shapes alone, before any tensor is read, so the same rule serves a
full file, a sharded directory and every wrapper:

    >>> match = match_keys(model_shapes(model), {'head.weight': torch.Size([80, 16])})
    >>> match.mismatched   # [('head.weight', torch.Size([80, 16]), torch.Size([3, 16]))]
"""
import dataclasses
import re
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ['KeyMatch', 'match_keys', 'model_shapes', 'revise']

RevisedKeys = Sequence[Tuple[str, str]]


@dataclasses.dataclass
class KeyMatch:
    """The outcome of matching a checkpoint's keys with a model's."""

    #: model key -> checkpoint key, for every entry that loads.
    loaded: Dict[str, str]
    #: model keys that the checkpoint does not provide.
    missing: List[str]
    #: checkpoint keys (as saved) that the model does not have.
    unexpected: List[str]
    #: (model key, shape in the checkpoint, shape in the model) of skipped entries.
    mismatched: List[Tuple[str, torch.Size, torch.Size]]

    @property
    def exact(self) -> bool:
        """Whether every key matched with its shape."""
        return not (self.missing or self.unexpected or self.mismatched)

    def report(self) -> str:
        """What did not load, in mmengine's (and torch's) wording."""
        lines = ['The model and loaded state dict do not match exactly\n']
        lines += [f'size mismatch for {key}: copying a param with shape {saved} from checkpoint, '
                  f'the shape in current model is {own}.' for key, saved, own in self.mismatched]
        if self.unexpected:
            lines.append(f'unexpected key in source state_dict: {", ".join(self.unexpected)}\n')
        if self.missing:
            lines.append(f'missing keys in source state_dict: {", ".join(self.missing)}\n')
        return '\n'.join(lines)


def revise(key: str, revise_keys: RevisedKeys) -> str:
    """``key`` after each ``(pattern, replacement)`` of ``revise_keys``, in order."""
    for pattern, replacement in revise_keys:
        key = re.sub(pattern, replacement, key)
    return key


def model_shapes(model: nn.Module) -> Dict[str, Optional[torch.Size]]:
    """The unwrapped model's state-dict keys and full (unsharded) shapes; nothing is gathered.

    Non-tensor entries (``_extra_state``) map to ``None``. Collective under
    FSDP: every rank calls it.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return {k: torch.Size(v.size()) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def match_keys(model: Mapping[str, Optional[torch.Size]],
               checkpoint: Mapping[str, Optional[torch.Size]],
               revise_keys: RevisedKeys = ()) -> KeyMatch:
    """Match checkpoint keys (renamed by ``revise_keys``) with model keys, by name and shape."""
    loaded, unexpected, mismatched = {}, [], []
    for saved_key, saved_shape in checkpoint.items():
        # A key the model has is its own (a child may be called 'module').
        key = saved_key if saved_key in model else revise(saved_key, revise_keys)
        if key not in model:
            unexpected.append(saved_key)
        elif saved_shape is not None and model[key] is not None and saved_shape != model[key]:
            mismatched.append((key, saved_shape, model[key]))
        else:
            loaded[key] = saved_key
    skipped = {key for key, _, _ in mismatched}
    # mmengine does not report BatchNorm's counters as missing.
    missing = [k for k in model if k not in loaded and k not in skipped
               and 'num_batches_tracked' not in k]
    return KeyMatch(loaded, missing, unexpected, mismatched)
