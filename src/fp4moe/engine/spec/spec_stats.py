"""Speculative decoding's counters (``SpecStats``): rounds, drafts, accepted drafts by position, backoffs --
what ``/metrics`` and ``fp4moe bench`` report as acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    disabled_steps: int = 0  # steps run without drafts because the batch was over the limit
    backed_off: int = 0  # times a sequence stopped drafting because its drafts were not accepted enough
    started_backed_off: int = 0  # requests that started without drafts: the latest rounds did not pay
    batch_backoffs: int = (
        0  # times a batch stopped drafting: its rounds served fewer tokens/s than plain steps
    )
    plain_probes: int = 0  # plain steps taken to time plain decoding at a batch size (``SpecCost``)

    def counts(self) -> dict[str, int]:
        """The counters ``/metrics`` shows (``pos<i>``: rounds whose draft at position i was accepted)."""
        values = dict(
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted,
            backoffs=self.backed_off,
            started_backed_off=self.started_backed_off,
            batch_backoffs=self.batch_backoffs,
        )
        return values | {f"pos{i}": v for i, v in enumerate(self.accepted_per_position)}

    def record(self, drafted: int, accepted: int) -> None:
        """One draft-and-verify round of one sequence."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0
