"""Test upstreams: a test CA, a scripted model server and HTTPS servers on an internal network."""

from .fixtures import RunResult, Upstream, Upstreams, start_upstreams, upstreams

__all__ = ["RunResult", "Upstream", "Upstreams", "start_upstreams", "upstreams"]
