"""The peak of one training step per rank: the sharding plan plus the traced activations.

On a CPU host::

    peak = state - grads + gathered + heap + max(activations - heap, grads)
           + max(traced transient, staging)

(``heap`` and ``staging``: CPU hosts only; the terms are explained in ``docs/plan.md``.)
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .memory import Plan
from .trace import StepTrace

__all__ = ['StepPeak', 'step_peak']


@dataclass(frozen=True)
class StepPeak:
    """The parts of a training step's peak on one rank, in bytes."""

    plan: Plan
    trace: StepTrace
    batch_size: int
    #: Set on a CPU host (:func:`.host.heap_threshold`): freed blocks below this many
    #: bytes stay resident, and collectives run on gloo. ``None``: an accelerator.
    heap_threshold: Optional[int] = None

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state (+ EMA) held between steps."""
        return self.plan.model_state_bytes_per_rank

    @property
    def gathered_bytes(self) -> int:
        """Unsharded parameters alive at once (0 when nothing is sharded)."""
        return self.plan.gathered_in_flight_bytes

    @property
    def activation_bytes(self) -> int:
        """What the forward leaves for backward (after checkpointing)."""
        return self.trace.activation_bytes

    @property
    def staging_bytes(self) -> int:
        """The unit gloo copies for itself during an all-gather / reduce-scatter (CPU host; else 0).

        Measured on 4 ranks: a 48 MiB reduce-scatter input raises the resident
        set by 49.7 MiB during the call, a 48 MiB all-gather output by 47.8 MiB
        (an all-reduce by 1.8 MiB: DDP stages nothing). The larger of the two:
        an all-gather output in the compute dtype, a reduce-scatter input in
        the reduce dtype (fp32 under ``param_dtype='bf16', reduce_dtype='fp32'``).
        """
        if self.heap_threshold is None or self.plan.spec.shard_size == 1:
            return 0
        return max(self.plan.largest_unit.gathered_bytes, self.plan.reduced_in_flight_bytes)

    @property
    def transient_bytes(self) -> int:
        """The largest short-lived allocation: the traced rise in backward, or gloo's staging."""
        return max(self.trace.transient_bytes, self.staging_bytes)

    @property
    def freed_grad_bytes(self) -> int:
        """Gradient bytes per rank that do not exist between steps (0: they stay allocated).

        With gradient accumulation (``accumulative_counts > 1``) the gradients
        (the shard, or the full gradients with ``accumulation='unsharded'``)
        live from the first micro-step's backward to the optimizer step, so the
        forwards of micro-steps 2..k add their activations to them.
        """
        if not self.plan.spec.grads_freed_between_steps or self.plan.accumulative_counts > 1:
            return 0
        return sum(u.grad_bytes for u in self.plan.units)

    @property
    def heap_activation_bytes(self) -> int:
        """Activations that stay resident after backward frees them (CPU heap; else 0)."""
        if self.heap_threshold is None:
            return 0
        return self.trace.activation_bytes_below(self.heap_threshold)

    @property
    def total_bytes(self) -> int:
        """The predicted peak per rank of one training step."""
        grads, heap = self.freed_grad_bytes, self.heap_activation_bytes
        return (self.model_state_bytes - grads + self.gathered_bytes + heap
                + max(self.activation_bytes - heap, grads) + self.transient_bytes)

    def to_dict(self) -> Dict[str, Any]:
        """The parts as plain JSON-able values."""
        trace = self.trace
        return dict(batch_size=self.batch_size, activation_checkpointing=list(trace.checkpointed),
                    compute_dtype=str(trace.compute_dtype).replace('torch.', ''),
                    autocast_dtype=trace.autocast_dtype and str(trace.autocast_dtype)[6:],
                    model_state_bytes=self.model_state_bytes, gathered_bytes=self.gathered_bytes,
                    activation_bytes=self.activation_bytes, transient_bytes=self.transient_bytes,
                    traced_transient_bytes=trace.transient_bytes, staging_bytes=self.staging_bytes,
                    grads_freed_between_steps_bytes=self.freed_grad_bytes,
                    heap_threshold_bytes=self.heap_threshold,
                    heap_activation_bytes=self.heap_activation_bytes,
                    peak_bytes=self.total_bytes, real_parts=list(trace.real_parts),
                    activation_bytes_by_unit={k or '(root)': v for k, v in trace.by_unit.items()})


#: Combine a plan and a trace of the same model (the trace's batch is one rank's);
#: ``heap_threshold``: training on a CPU host, from :func:`.host.heap_threshold`.
step_peak = StepPeak
