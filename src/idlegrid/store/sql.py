"""`SqlStore`: the store on SQLAlchemy 2 (async), SQLite or PostgreSQL, as its roles.

Each role is one module and one class over the shared `Database` (store/database.py:
engine, migrations, transactions, batches): `store.accounts`, `store.nodes`,
`store.jobs`, `store.claims`, `store.scheduling`, `store.results`, `store.rounds`,
`store.web`, `store.blob_owners`, `store.blob_uploads`, `store.usage`, `store.verification`,
`store.node_control`. An operation is
written once, as a method of its role that holds its SQL; callers write
`store.jobs.create_job(...)`. `SqlStore` composes the roles and runs batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from idlegrid.store.accounts import Accounts
from idlegrid.store.blob_owners import BlobOwners
from idlegrid.store.blob_uploads import BlobUploads
from idlegrid.store.claims import Claims
from idlegrid.store.database import Database
from idlegrid.store.jobs import Jobs
from idlegrid.store.node_control import NodeControl
from idlegrid.store.nodes import Nodes
from idlegrid.store.results import Results
from idlegrid.store.rounds import TrainingRounds
from idlegrid.store.scheduling import Scheduling
from idlegrid.store.usage import Usage
from idlegrid.store.verification import Verification
from idlegrid.store.web import Web
from idlegrid.verification.trust import TrustSettings

R = TypeVar("R")


class SqlStore:
    """Durable state in one SQL database (SQLite file or PostgreSQL), as roles."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "",
        echo: bool = False,
        trust: TrustSettings | None = None,
    ) -> None:
        """`schema`: PostgreSQL schema to use (made on `open`); empty: the default.

        `trust`: the policy the store applies to trust rows when it records verdicts.
        """
        self.db = Database(url, schema=schema, echo=echo, trust=trust)
        self.url = url
        self.schema = schema
        self.engine: AsyncEngine = self.db.engine
        self.is_sqlite = self.db.is_sqlite
        # Whether commits run one at a time (SQLite), so that fewer, bigger ones pay.
        self.serial_commits = self.db.serial_commits
        self.accounts = Accounts(self.db)
        self.nodes = Nodes(self.db)
        self.node_control = NodeControl(self.db)
        self.jobs = Jobs(self.db)
        self.claims = Claims(self.db)
        self.scheduling = Scheduling(self.db)
        self.results = Results(self.db)
        self.rounds = TrainingRounds(self.db)
        self.web = Web(self.db)
        self.blob_owners = BlobOwners(self.db)
        self.blob_uploads = BlobUploads(self.db)
        self.usage = Usage(self.db)
        self.verification = Verification(self.db)

    @property
    def trust(self) -> TrustSettings:
        """The trust policy every role applies (`Database.trust`)."""
        return self.db.trust

    @trust.setter
    def trust(self, settings: TrustSettings) -> None:
        self.db.trust = settings

    async def open(self) -> None:
        """Bring the schema to the newest migration (one process at a time on PostgreSQL)."""
        await self.db.open()

    async def close(self) -> None:
        await self.db.close()

    def batch(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The calls made inside share one transaction (committed once, all or nothing;
        `Database.batch`)."""
        return self.db.batch()

    async def run_batch(self, work: Callable[[], Awaitable[R]]) -> R:
        """`work()` in one `batch`, run again (a few times) when it met `StoreConflict`."""
        return await self.db.run_batch(work)

    async def after_commit(self, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` once the caller's writes are committed (at the end of a running
        `batch`, never if it rolls back; at once outside one)."""
        await self.db.after_commit(action)
