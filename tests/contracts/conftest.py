"""Shared setup of the contract suites.

Each adapter module (``test_<adapter>_broker.py``) subclasses a contract from
``eventflow.testing`` and defines the ``broker_factory`` fixture it needs; the contracts
themselves need nothing else from here. The leaked-task check every test gets is in
``tests/conftest.py``.
"""
