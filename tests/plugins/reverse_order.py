"""`-p reverse_order` (with tests/plugins on PYTHONPATH): run the selected tests in reverse order, to show that none
depends on what an earlier one left (`make test-reverse`)."""


def pytest_collection_modifyitems(session, config, items):  # pytest's hook signature
    items.reverse()
