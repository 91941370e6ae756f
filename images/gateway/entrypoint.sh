#!/bin/sh
# Starts mitmdump with fila's addon (fila_gateway.py, next to this file): the forward proxy on
# 3128 (regular mode) and the model routes on 8080 (reverse mode; the addon rewrites each request
# to its route's upstream). launch.py binds the doors' sockets first (and writes `listening`), then
# becomes mitmdump, which serves them once the addon has its config.
# - The reverse target below is a sink the addon listens on (127.0.0.1:3127). mitmproxy connects
#   to it when a route client connects (connection_strategy eager, which CONNECT needs: the tunnel
#   is opened to the checked address before the 200, and server-speaks-first protocols work; and
#   mitmproxy refuses to connect to its own listeners), but no request is sent there: the addon
#   sends each to its route's upstream.
# - allow_hosts lists only that target, so mitmproxy's own layer choice for anything else (a
#   CONNECT tunnel) is a raw relay, never TLS interception; the addon picks a raw relay itself.
# - mitmproxy's CA (made in the tmpfs confdir) is thus never shown to a client.
# - body_size_limit: a request body past 32 MiB is refused (413) rather than held in memory (route
#   bodies are read whole to be rewritten; responses are streamed and not limited).
# - http2=false: the route port speaks HTTP/1 only (HTTP/2 pseudo-headers would reach an upstream's
#   HTTP/1 head unchecked); the addon also closes a route client that starts TLS.
# - rawtcp=false: an upstream's 101 never turns a connection into an unfiltered raw pipe (the addon
#   refuses a 101 on a route before it is sent; on the proxy door the connection is closed).
# Extra arguments are passed on to mitmdump (e.g. --set termlog_verbosity=debug).
set -eu
proxy_port="${FILA_GATEWAY_PROXY_PORT:-3128}"
sink_port="${FILA_GATEWAY_SINK_PORT:-3127}"
exec python3 -S "$(dirname "$0")/launch.py" \
    --mode "regular@${proxy_port}" \
    --mode "reverse:http://127.0.0.1:${sink_port}@${FILA_GATEWAY_ROUTE_PORT:-8080}" \
    --set listen_host="${FILA_GATEWAY_LISTEN_HOST:-}" \
    --set allow_hosts="^127\.0\.0\.1:${sink_port}\$" \
    --set confdir=/tmp/mitmproxy \
    --set connection_strategy=eager \
    --set onboarding=false \
    --set flow_detail=0 \
    --set termlog_verbosity=warn \
    --set http3=false \
    --set body_size_limit=32m \
    --set http2=false \
    --set rawtcp=false \
    -s "$(dirname "$0")/fila_gateway.py" \
    "$@"
