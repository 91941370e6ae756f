"""The gateway's proxy process: mitmproxy's Master with only the addons the gateway uses, its
options set here (launch.py execs serve.py, which calls `main`).

mitmdump loads all of mitmproxy's default addons whatever the options (its web onboarding app,
proxy authentication with passlib and ldap3, flow filters, playback, export, ...) and parses its
whole command line; on this image that is about a third of its start-up, and it makes a CA key
at every start that fila never shows a client. What this master keeps is what serves the two
doors under the options entrypoint.sh gave mitmdump, in mitmdump's order (hooks run in it):

- `Core` (option checks), `Block` (block_global: only private peers), `DisableH2C`,
  `Proxyserver` (the listeners, taken over by the addon: fila_gateway.py `_listen`);
- fila's addon (fila_gateway.py) where mitmdump's script loader stood: before `NextLayer`, so
  its `next_layer` decides a proxy-door connection first;
- `NextLayer`, `TlsConfig` (TLS to a route's upstream) with its CA made on first use
  (`LazyCaTlsConfig`), `UpdateAltSvc`, `ErrorCheck` (an error logged at start-up exits: no
  gateway without its policy), and the terminal log.

The addons left out are inert under these options (dumper at flow_detail 0, onboarding off, no
proxyauth, no scripts, no replay, no save, no maps or header changes). Measured in
docs/benchmarks.md, "The one-shot path".
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

import fila_gateway  # the addon beside this package (images/gateway)
from mitmproxy import certs, options
from mitmproxy.addons import (
    block,
    core,
    disable_h2c,
    errorcheck,
    next_layer,
    proxyserver,
    tlsconfig,
    update_alt_svc,
)
from mitmproxy.master import Master

from .config import PROXY_PORT, ROUTE_PORT, SINK_PORT

# - mode: the forward proxy (regular) and the model routes (reverse). The reverse target is a sink
#   the addon listens on (127.0.0.1:SINK_PORT). mitmproxy connects to it when a route client
#   connects (connection_strategy eager, which CONNECT needs: the tunnel is opened to the checked
#   address before the 200, and server-speaks-first protocols work; and mitmproxy refuses to
#   connect to its own listeners), but no request is sent there: the addon sends each to its
#   route's upstream.
# - allow_hosts lists only that target, so mitmproxy's own layer choice for anything else (a
#   CONNECT tunnel) is a raw relay, never TLS interception; the addon picks a raw relay itself.
#   mitmproxy's CA (made in the tmpfs confdir, if ever) is thus never shown to a client.
# - body_size_limit: a request body past 32 MiB is refused (413) rather than held in memory
#   (route bodies are read whole to be rewritten; responses are streamed and not limited).
# - http2=false: the route port speaks HTTP/1 only (HTTP/2 pseudo-headers would reach an
#   upstream's HTTP/1 head unchecked); the addon also closes a route client that starts TLS.
# - rawtcp=false: an upstream's 101 never turns a connection into an unfiltered raw pipe (the
#   addon refuses a 101 on a route before it is sent; on the proxy door the connection is closed).
OPTIONS: dict[str, Any] = {
    "mode": [f"regular@{PROXY_PORT}", f"reverse:http://127.0.0.1:{SINK_PORT}@{ROUTE_PORT}"],
    "listen_host": os.environ.get("FILA_GATEWAY_LISTEN_HOST", ""),
    "allow_hosts": [rf"^127\.0\.0\.1:{SINK_PORT}$"],
    "confdir": "/tmp/mitmproxy",
    "connection_strategy": "eager",
    "termlog_verbosity": "warn",
    "http3": False,
    "body_size_limit": "32m",
    "http2": False,
    "rawtcp": False,
}
# The options whose change makes TlsConfig load (or make) its CA.
_CA_OPTIONS = {"certs", "confdir", "key_size", "cert_passphrase"}


class LazyCaTlsConfig(tlsconfig.TlsConfig):
    """TlsConfig whose CA (certstore) is loaded, or made, when a client's TLS is first
    intercepted (`get_cert`, which both of TlsConfig's client-side starts call first), not at
    every start: the gateway intercepts none (allow_hosts lists only its plain-HTTP sink; a
    CONNECT is relayed raw), so the RSA key mitmdump makes and then loads twice at start (about
    0.15 s) is never needed. TLS to a route's upstream needs no CA of the gateway's."""

    def configure(self, updated: Any) -> None:
        keys = {updated} if isinstance(updated, str) else set(updated)
        if keys & _CA_OPTIONS:
            self.certstore = None  # type: ignore[assignment]  # made from the new options when needed
        super().configure(keys - _CA_OPTIONS)

    def running(self) -> None:
        """TlsConfig's own loads the CA again (a workaround for mitmproxy's console): not here."""

    def get_cert(self, conn_context: Any) -> certs.CertStoreEntry:
        if self.certstore is None:
            super().configure(_CA_OPTIONS)
        return super().get_cert(conn_context)


def addons(gateway: list[Any]) -> list[Any]:
    """The master's addons in mitmdump's order, fila's `gateway` addons where its scripts stood."""
    return [
        core.Core(),
        block.Block(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        *gateway,
        next_layer.NextLayer(),
        LazyCaTlsConfig(),
        update_alt_svc.UpdateAltSvc(),
        errorcheck.ErrorCheck(),
    ]


def parse_sets(args: list[str]) -> list[str]:
    """`--set name=value` pairs (extra arguments of entrypoint.sh, e.g. termlog_verbosity=debug);
    anything else is a usage error (SystemExit 2)."""
    if len(args) % 2 or any(flag != "--set" for flag in args[::2]):
        print(f"fila_gateway: usage: entrypoint.sh [--set NAME=VALUE ...], got {args}", file=sys.stderr)
        raise SystemExit(2)
    return args[1::2]


async def serve(sets: list[str]) -> None:
    for name, level in (("tornado", logging.WARNING), ("asyncio", logging.WARNING), ("hpack", logging.WARNING)):
        logging.getLogger(name).setLevel(level)
    logging.getLogger().setLevel(logging.DEBUG)
    opts = options.Options()
    master = Master(opts, with_termlog=True)
    master.addons.add(*addons(fila_gateway.addons))
    try:
        opts.update(**OPTIONS)
        opts.set(*sets)
    except Exception as e:  # mitmproxy's OptionsError: a bad option is a bad start
        print(f"fila_gateway: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a client gone mid-write is not the proxy's end
    await master.run()


def main(argv: list[str]) -> None:
    asyncio.run(serve(parse_sets(argv)))
