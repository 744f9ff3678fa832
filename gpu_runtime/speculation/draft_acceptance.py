"""Acceptance by draft position for drafters that give no token probabilities (n-gram / prompt lookup).

The speculation policies rank draft tokens by path probability (AdaServe's selection, AdaSpec's
efficiency estimator, the likelihood rule beyond the scheduler's slack). A model-free drafter gives
none, so the probability of a chain's i-th token comes from how often such tokens were accepted:
the conditional rate q_i = P(token i accepted | tokens 1..i-1 accepted), and the path probability
of token i is q_1 * ... * q_i (AdaServe section 4, AdaSpec eq. 4's product of confidences).

One rate for every position understates long chains of a copying drafter: once a lookup's first
tokens match, the text it copies tends to go on matching, so q grows with the position. The rates
here are kept per position from each verified chain: a chain of k tokens of which a were accepted
tried positions 1..min(a + 1, k) and passed 1..a.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PositionAcceptance:
    longest: int  # the drafter's longest chain
    prior: float = 0.6  # the rate of a position before any chain reached it
    weight: float = 0.02  # EMA weight of one verified token (a step of batch B brings up to B per position)
    rates: list[float] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)  # verified tokens per position

    def __post_init__(self) -> None:
        if self.longest < 1:
            raise ValueError(f"longest draft must be >= 1 (got {self.longest})")
        self.rates = [self.prior] * self.longest
        self.seen = [0] * self.longest

    def observe(self, verified: int, accepted: int) -> None:
        """One chain's outcome: ``verified`` draft tokens, the first ``accepted`` of them accepted."""
        for i in range(min(accepted + 1, verified, self.longest)):
            hit = 1.0 if i < accepted else 0.0
            self.rates[i] += self.weight * (hit - self.rates[i])
            self.seen[i] += 1

    def conditionals(self, length: int) -> list[float]:
        """q_1..q_length. A position no chain has reached yet takes the rate of the deepest one measured
        (the prior before any): a drafter whose deeper tokens were never verified keeps a way to lengthen."""
        out, last = [], self.prior
        for i in range(length):
            if i < self.longest and self.seen[i]:
                last = self.rates[i]
            out.append(last)
        return out
