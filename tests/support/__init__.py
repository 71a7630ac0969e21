"""Helpers shared by the tests. The scripts among them (train_subprocess, dp_trainer) run in processes of
their own as modules, `python -m tests.support.NAME`, with the repository root as the working folder or
on PYTHONPATH."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
