"""App.repository: a Repository bound to the app's store and name."""

from eventflow import Aggregate, App, Event, on


class AccountOpened(Event, type="agg.account.opened"):
    """An account was opened."""


class Account(Aggregate):
    """An account."""

    opened: bool = False

    @on(AccountOpened)
    def _opened(self, e: AccountOpened) -> None:
        self.opened = True


async def test_app_repository_uses_the_app_store_and_name() -> None:
    app = App("bank", store="memory://")
    async with app:
        repo = app.repository(Account, snapshot_every=1)
        account = Account(id="a")
        account.record(AccountOpened())
        await repo.save(account)
        [rec] = [r async for r in app.store.read_stream("account-a")]
        assert rec.envelope.source == "bank"
        assert (await repo.load("a")).opened is True
        assert await app.store.load_snapshot("account-a") is not None
