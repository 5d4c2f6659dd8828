"""The probe job's defaults, shared by the option parser (``cli``) and the checks (``run``).

In their own module so that ``run`` need not import ``cli`` (which imports ``run`` to dispatch), and so that
registering ``doctor`` on the main CLI still imports nothing heavy.
"""

from __future__ import annotations

__all__ = ["DEFAULT_PROBE_NODES", "DEFAULT_PROBE_TIMEOUT_S"]

DEFAULT_PROBE_TIMEOUT_S = 120.0
DEFAULT_PROBE_NODES = 2
