"""Perplexity of a language model, accumulated over a whole evaluation."""
import math
from typing import Dict, List, Sequence

from mmengine.evaluator import BaseMetric

from mmfsdp.registry import METRICS


@METRICS.register_module()
class Perplexity(BaseMetric):
    """Token-weighted mean NLL and its exponential, the perplexity.

    Consumes the ``'predict'`` outputs of ``mmfsdp.GPT``: one dict per sample
    with ``nll`` (summed token negative log-likelihood) and ``num_tokens``.
    Sums are kept rather than per-batch means so the result is exact however
    the samples are split across batches and ranks.

    Reports ``nll`` (mean nats per token) and ``perplexity``; mmengine
    prefixes them with ``prefix`` (default ``'lm'``), e.g. ``lm/perplexity``.
    The mean is deliberately not called ``loss``: mmengine's LogProcessor
    averages every scalar whose name contains ``loss`` over its last
    ``window_size`` values, which would blend successive validations.
    """

    default_prefix = 'lm'

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Store each sample's NLL sum and token count as Python numbers."""
        for sample in data_samples:
            self.results.append(
                dict(nll=float(sample['nll']),
                     num_tokens=int(sample['num_tokens'])))

    def compute_metrics(self, results: List[dict]) -> Dict[str, float]:
        """Reduce the samples of all ranks to mean NLL and perplexity."""
        num_tokens = sum(r['num_tokens'] for r in results)
        if num_tokens == 0:
            raise ValueError('Perplexity got no tokens to evaluate')
        nll = sum(r['nll'] for r in results) / num_tokens
        return dict(nll=nll, perplexity=math.exp(nll))
