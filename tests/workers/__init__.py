"""What the tests' child processes run: one ``<topic>_workers.py`` per test file or group.

A test that starts a ``spawn`` child (``multiprocessing.get_context("spawn")``, the
``spawn`` fixture) hands it a function of a module here.  The child re-imports that module
by its qualified name (``workers.mp_workers``), which works because pytest puts ``tests/``
on ``sys.path`` (pyproject's ``pythonpath``) and a ``spawn`` child inherits the parent's
``sys.path``; a function defined in a test module would make the child import the test
module instead.  ``trust_workers.py`` is a script run by its path (``python
tests/workers/trust_workers.py``).
"""
