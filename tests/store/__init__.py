"""The cluster tier against real stores (a package: its conftest.py must not shadow
tests/conftest.py, which test modules import as ``conftest``)."""
