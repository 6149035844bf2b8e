"""The parwatch sidecar: Prometheus exporter, guardrail host and directive source for one run.

Start it with `parwatch sidecar`; build it in code with
`build_sidecar(SidecarConfig(...))` and serve `create_metrics_app` / `create_control_app`.
"""

from parwatch.sidecar.config import ConfigError, SidecarConfig

__all__ = ["ConfigError", "SidecarConfig"]
