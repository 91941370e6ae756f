"""The gateway's proxy process (launch.py execs it with the sockets it bound): fila_gw/master.py.
Extra arguments are `--set NAME=VALUE` pairs of mitmproxy options."""

import sys

from fila_gw.slim import addons_package_without_defaults

addons_package_without_defaults()  # before anything imports mitmproxy.addons (fila_gw/slim.py)

from fila_gw.master import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:])
