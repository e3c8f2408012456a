"""The test suite (a package, so that tests/benchmarks/ and tests/families/
may hold files of the same names as tests/, and the tests import their
shared helpers as `tests.helpers`)."""
