"""``pdserve up``: a whole disaggregated deployment on one host with one command.

Starts N prefillers (``pdserve serve MODEL`` with ``kv_role=kv_producer``), M decoders
(``kv_role=kv_consumer``) and the proxy (``pdserve proxy``) as separate child processes, waits
until every part answers ``GET /health`` with a progress display, prints the endpoint with
ready-to-paste examples, and supervises the children until Ctrl-C.

* :mod:`~pdserve.launcher.plan`: ports, GPUs, environment and command line of each part
  (:mod:`~pdserve.launcher.ports`: free ports; :mod:`~pdserve.launcher.errors`: LaunchError).
* :mod:`~pdserve.launcher.supervisor`: starting the parts, health, death and shutdown.
* :mod:`~pdserve.launcher.restarts`: restarting a dead engine instance while its role serves.
* :mod:`~pdserve.launcher.children`: one child process, its process group and its log.
* :mod:`~pdserve.launcher.cli`: argparse, pass-through of engine options, progress and banner.
"""

from pdserve.launcher.cli import build_parser, engine_args_error, main, parse_args, usage_banner
from pdserve.launcher.errors import LaunchError
from pdserve.launcher.plan import (
    SHARED_GPU_MEMORY_FRACTION,
    ChildCommands,
    ChildSpec,
    assign_gpus,
    build_plan,
    kv_transfer_config,
    option_value,
)
from pdserve.launcher.ports import ENGINE_HOST, allocate_free_ports, connect_host, ensure_port_free
from pdserve.utils.host_devices import detect_gpus
from pdserve.launcher.children import Child, tail_lines
from pdserve.launcher.restarts import InstanceState, RestartPolicy, Restarter
from pdserve.launcher.supervisor import STATUS_FILE_NAME, Launcher

__all__ = [
    "ENGINE_HOST", "SHARED_GPU_MEMORY_FRACTION", "STATUS_FILE_NAME", "Child", "ChildCommands",
    "ChildSpec", "InstanceState", "LaunchError", "Launcher", "RestartPolicy", "Restarter", "allocate_free_ports", "assign_gpus", "build_parser",
    "build_plan", "connect_host", "detect_gpus", "engine_args_error", "ensure_port_free",
    "kv_transfer_config", "main",
    "option_value", "parse_args", "tail_lines", "usage_banner",
]
