"""Several hosts on one machine on shaped links (network namespaces, ``tc``), and what runs on them.

Tooling at the edge of gradsift: the core never imports it. ``hosts`` builds and
tears down the namespaces and runs ``torchrun`` on them; ``relay`` is the
userspace link emulator for delay and loss; ``netbench`` measures collectives
and fits the alpha-beta model; ``bench`` is ``gradsift cluster bench``.
"""

from .hosts import Cluster, ClusterError, Link, TearDown, check_environment, run_on_cluster, torch_env

__all__ = ["Cluster", "ClusterError", "Link", "TearDown", "check_environment", "run_on_cluster", "torch_env"]
