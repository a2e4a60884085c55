"""Shared test setup: make tests/ importable (harness, conformance battery)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
