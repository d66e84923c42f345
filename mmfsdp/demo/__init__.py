"""Demo workload: a character-level GPT trained on Python stdlib source.

Importing this package registers ``GPT`` (MODELS), ``StdlibCharDataset``
(DATASETS) and ``Perplexity`` (METRICS) under the ``mmfsdp`` scope.
"""
from .blocks import TransformerBlock
from .gpt import GPT
from .metric import Perplexity
from .stdlib_text import StdlibCharDataset

__all__ = ['GPT', 'Perplexity', 'StdlibCharDataset', 'TransformerBlock']
