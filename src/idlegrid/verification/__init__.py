"""Verification: who is right, who is trusted, who is paid. Pure rules, no I/O.

From a shard's results (plain records), its nodes' trust and its job's policy, these
modules return decisions and ledger deltas; the store reads the rows they need and
writes what they return, the coordinator does the I/O around them.

- `quorum`: which of a shard's results is canonical, which are invalid.
- `judging`: when a shard may be decided, with what credibility, and what an
  undecided one needs next (suspects, escalation, one more replica).
- `replication`: how many replicas an open shard still needs; what a decision's
  results earn (their verdicts).
- `trust`: a node's trust per kind and backend, stepped by each verdict.
- `credit`: the price of validated work and the decayed credit totals.
- `ledger`: the delta of a set of verdicts: trust changes, credit grants and take-backs.
- `recheck`: what a node caught lying sent back to full replication.
- `audit`: which of a job's lone shards are spot-checked before it completes.
- `collusion`: accounts wrong together, the same way, often enough to be flagged.
- `stalemate`: a shard no eligible node is left for, decided on its evidence or failed.
"""
