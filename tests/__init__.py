"""The test suite, a package so that tests import their helpers as `tests.support.*`: pytest puts the
repository root (the first folder above without an __init__.py) on sys.path. Run it from the root:
`python -m pytest -q`.

    unit/         one component, in process, fast
    integration/  the Trainer end to end, the CLI, examples and notebooks, crashes, launchers (subprocesses)
    gpu/          what only runs with CUDA (marked `gpu`; skipped on a CPU-only machine)
    support/      tiny models and batches, the deprecation guard, scripts run as `python -m tests.support.NAME`
"""
