#!/bin/sh
# Starts mitmdump with fila's addon: the forward proxy on 3128 (regular mode) and the model
# routes on 8080 (reverse mode; the addon rewrites each request to its route's upstream, so the
# reverse target below is never connected to). CONNECT tunnels are relayed raw by the addon's
# next_layer hook, so mitmproxy's CA (made in the tmpfs confdir) is never shown to a client.
# connection_strategy=lazy: no connection is opened before the addon has checked the request.
# Extra arguments are passed on to mitmdump (e.g. --set termlog_verbosity=debug).
set -eu
exec mitmdump \
    --mode "regular@${FILA_GATEWAY_PROXY_PORT:-3128}" \
    --mode "reverse:http://127.0.0.1:9@${FILA_GATEWAY_ROUTE_PORT:-8080}" \
    --set listen_host="${FILA_GATEWAY_LISTEN_HOST:-}" \
    --set confdir=/tmp/mitmproxy \
    --set connection_strategy=lazy \
    --set onboarding=false \
    --set flow_detail=0 \
    --set termlog_verbosity=warn \
    --set http3=false \
    -s "$(dirname "$0")/fila_gateway.py" \
    "$@"
