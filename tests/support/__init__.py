"""What the test modules share: fixtures, factories of tiny models, one ``wait_for`` (wait.py), one
process harness (procs.py), Redis servers and groups, test hosts, and the drivers of the gateway, the
pipeline and the fault tests. A test module imports from here, never from another test module
(tests/test_structure.py checks it)."""
