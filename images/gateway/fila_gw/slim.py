"""mitmproxy's `mitmproxy.addons` package without its `__init__`: that file imports every one of
mitmproxy's default addons (for `default_addons()`, which only mitmdump, mitmproxy and mitmweb
call), so importing any one addon module loads them all: the web onboarding app (flask), proxy
authentication (passlib, ldap3), the flow filter grammar (pyparsing) and more, about 0.2 s of the
gateway's start (docs/benchmarks.md, "The one-shot path"). The gateway's master
(fila_gw/master.py) imports the few addon modules it uses; with the package registered here first,
each is loaded on its own from the package's directory, exactly as mitmproxy ships it.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def addons_package_without_defaults() -> None:
    """Register `mitmproxy.addons` as its bare package (its directory, not its `__init__`), before
    anything imports it; a later `from mitmproxy.addons import x` loads module x alone."""
    if "mitmproxy.addons" in sys.modules:
        return  # imported already (whole): nothing to save
    spec = importlib.util.find_spec("mitmproxy.addons")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("mitmproxy.addons is not a package here")
    pkg = types.ModuleType("mitmproxy.addons", "mitmproxy's addons, loaded one by one (fila_gw/slim.py)")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__package__ = "mitmproxy.addons"
    sys.modules["mitmproxy.addons"] = pkg
    import mitmproxy

    mitmproxy.addons = pkg  # type: ignore[attr-defined]
