#!/bin/sh
# `pypi`: pypiserver on 8080 serving /srv/pypi/packages; `npm`: verdaccio on 4873 serving the
# seeded storage. Neither ever forwards to a public index (see the Dockerfile).
set -eu
case "${1:-}" in
pypi)
    # --disable-fallback: a name it does not hold is a 404, not a redirect to pypi.org. Uploads
    # need a login and there is no password file: nobody can upload. -v: every request logged.
    exec /opt/pypiserver/bin/pypi-server run -v --host 0.0.0.0 --port 8080 --disable-fallback \
        /srv/pypi/packages
    ;;
npm)
    exec /opt/verdaccio/node_modules/.bin/verdaccio --config /etc/verdaccio/config.yaml \
        --listen 0.0.0.0:4873
    ;;
*)
    echo "usage: pkgindex pypi|npm" >&2
    exit 2
    ;;
esac
