from orchestrator.store import RunStore


async def test_fixture_gives_an_empty_migrated_database(store: RunStore) -> None:
    assert await store.list_runs() == []
