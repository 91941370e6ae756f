#!/bin/sh
# Starts the gateway: launch.py binds the doors' sockets (and writes `listening`), then becomes
# serve.py, mitmproxy with fila's addon (fila_gateway.py) and only the addons it needs
# (fila_gw/master.py, which also holds the options and says why each is set): the forward proxy
# on 3128 (regular mode) and the model routes on 8080 (reverse mode; the addon rewrites each
# request to its route's upstream), served once the addon has its config.
# Extra arguments are mitmproxy options for serve.py (e.g. --set termlog_verbosity=debug).
set -eu
exec python3 -S "$(dirname "$0")/launch.py" "$@"
