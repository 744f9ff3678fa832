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

A drafter that sizes its own proposals says more: suffix decoding proposes as many tokens as its
suffix tree scores likely, so a 12-token proposal is a confident one (measured on SpecBench
summaries at batch 1: 80% of such tokens accepted) and a 1-token proposal a guess (20%). Pooled,
the guesses pull the first position's rate down and with it every long chain's path probability,
and the policies trimmed the confident chains. ``ProposalAcceptance`` keeps the rates apart for
each size class of proposal and falls back to the pooled rate where a class has seen too little.
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
            # the mean of the tokens seen so far (the prior counting as one) until there are 1/weight of them,
            # then the EMA: deep positions, which few chains reach, leave the prior as fast as the first ones
            w = max(self.weight, 1.0 / (self.seen[i] + 2))
            self.rates[i] += w * (hit - self.rates[i])
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


def size_class(proposed: int) -> int:
    """Proposals of 1, 2-3, 4-7, 8-15, ... tokens: a class per power of two."""
    return max(proposed, 1).bit_length()


@dataclass
class ProposalAcceptance:
    """Acceptance by position, apart for each size class of the drafter's proposal (see the module's text)."""

    longest: int
    min_seen: int = 8  # verified tokens a class needs at a position before its own rate replaces the pooled one
    pooled: PositionAcceptance = field(init=False)
    by_size: dict[int, PositionAcceptance] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.pooled = PositionAcceptance(self.longest)

    def observe(self, proposed: int, verified: int, accepted: int) -> None:
        """A chain the drafter proposed with ``proposed`` tokens, of which the first ``verified`` were verified."""
        self.pooled.observe(verified, accepted)
        cls = size_class(proposed)
        if cls not in self.by_size:
            self.by_size[cls] = PositionAcceptance(self.longest)
        self.by_size[cls].observe(verified, accepted)

    def conditionals(self, length: int, proposed: int) -> list[float]:
        """q_1..q_length of a chain the drafter proposed with ``proposed`` tokens."""
        pooled = self.pooled.conditionals(length)
        own = self.by_size.get(size_class(proposed))
        if own is None:
            return pooled
        return [own.rates[i] if i < own.longest and own.seen[i] >= self.min_seen else q
                for i, q in enumerate(pooled)]

    @property
    def rates(self) -> list[float]:
        return self.pooled.conditionals(self.longest)
