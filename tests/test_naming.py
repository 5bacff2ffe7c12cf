"""One name, one concept: modules that share a name are layers of one concept.

docs/architecture.md ("A concept's layers: one name") places a concept's layers under one
name: `store/trust.py` is the SQL of `verification/trust.py`, `dashboard/accounts.py` the
pages of what `store/accounts.py` keeps. Every module name used twice or more is listed
here with the concept it names, so a new module that takes a name of another meaning
fails here, as does an entry left behind by a rename.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "idlegrid"

# name -> the concept every module of that name is a layer of.
SHARED = {
    "accounts.py": "an account: its REST API, its SQL, its pages",
    "audit.py": "a job's lone results spot-checked before it completes: the rule and its SQL",
    "collusion.py": "accounts wrong together: the rule and its SQL",
    "jobs.py": "a job: its REST API and its SQL",
    "judging.py": "a shard's decision: the rule and its SQL",
    "ledger.py": "verdicts and credit: the rule and its SQL",
    "node_control.py": "a volunteer's settings of a node: the coordinator's and the SQL",
    "recheck.py": "a caught liar's lone shards checked again: the rule and its SQL",
    "replication.py": "a shard's replication: the rule and its SQL",
    "rounds.py": "training rounds: the kind's round hooks and their SQL",
    "stalemate.py": "shards no node can add a result to: rule, pass and SQL",
    "trust.py": "a node's trust: the rule and its SQL",
    "uploads.py": "a blob sent in chunks: its REST API, its SQL, its pages",
    # A family: each package's interfaces and records.
    "base.py": "a package's interfaces and records",
    # A family: the same part of each kind (and the CLI of a researcher's model).
    "kind.py": "a kind's TaskKind",
    "run.py": "a kind's run on a node",
    "data.py": "a kind's input data",
    "shard.py": "a kind's shard payload",
    "model.py": "a researcher's model: a kind's reading of it, the CLI that prepares it",
    "runtime.py": "a kind's runtime on the node",
    "samples.py": "a kind's sample inputs",
}
# Names two modules of different meaning still share, to be renamed.
TO_RENAME = {
    "downloads.py": "worker/downloads.py is the node's daily download cap; "
    "dashboard/downloads.py is the /download page",
}


def shared_names() -> dict[str, list[str]]:
    """Module names (not `__init__.py`) used by two modules or more, with their paths."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or "migrations" in relative.parts:
            continue
        paths[path.name].append(relative.as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_every_shared_module_name_is_one_concept() -> None:
    unlisted = {
        name: found
        for name, found in shared_names().items()
        if name not in SHARED and name not in TO_RENAME
    }
    assert unlisted == {}, "modules of one name: list the concept they share, or rename one"


def test_every_listed_name_is_still_shared() -> None:
    assert (set(SHARED) | set(TO_RENAME)) - set(shared_names()) == set()
