"""The path of an engine's ``GET /pdserve/instance`` route (its P/D role and chat template; the
route: :mod:`pdserve.entrypoints.instance_info`), shared with the proxy and the launcher that ask it."""

#: Path of the route (outside ``/v1``: no API key, like ``/health``).
INSTANCE_INFO_PATH = "/pdserve/instance"
